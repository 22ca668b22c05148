"""A worker process's answers reach the supervisor a read at a time (a real child)."""

from __future__ import annotations

import asyncio

from pepsi.dispatch.policy.decisions import Exit
from pepsi.dispatch.pools.workers import WorkerProcess
from pepsi.protocol import Answer


def _run(script: str, ids: list[int]) -> tuple[list[list[Answer]], Exit]:
    """Start `sh -c script` as a worker holding `ids`; its answers, call by call, and exit."""
    calls: list[list[Answer]] = []
    exits: list[Exit] = []

    async def main() -> None:
        worker = WorkerProcess(
            1,
            "s",
            ["sh", "-c", script],
            {},
            on_ready=lambda _w: None,
            on_statuses=lambda _w, answers: calls.append(list(answers)),
            on_answers=lambda _w, _seconds: None,
            on_exit=lambda _w, exit_: exits.append(exit_),
            kill_grace=2.0,
        )
        await worker.start(ids)
        assert worker._task is not None
        await worker._task

    asyncio.run(main())
    return calls, exits[0]


def test_the_lines_of_one_write_are_handed_over_in_one_call() -> None:
    # one printf: one write on the pipe, read whole by the dispatcher's one read
    calls, exit_ = _run(r"printf 'ready\n0\n1\n75\n'; read _", [1, 2, 3])
    assert [[(wid, s.status) for wid, s in call] for call in calls] == [[(1, 0), (2, 1), (3, 75)]]
    assert exit_.unanswered == ()


def test_answers_before_an_unreadable_line_are_handed_over_before_the_kill() -> None:
    calls, exit_ = _run(r"printf 'ready\n0 [[\"s\",5]]\ngarbage\n'; exec sleep 30", [1, 2, 3])
    assert [[wid for wid, _ in call] for call in calls] == [[1]]
    assert exit_.garbled
    assert exit_.unanswered == (2, 3)  # 2, the head, was answered unreadably
    assert "unreadable status line" in exit_.reason
