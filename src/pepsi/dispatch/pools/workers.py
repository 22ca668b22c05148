"""One worker process as the dispatcher sees it: a thin asyncio shell.

It writes ids to the child's stdin, reads `ready` and status lines from its
stdout, and tells the pool supervisor what happened through four callbacks.
The child's stderr is the dispatcher's, so a worker's log lines land in the
same journal. Decisions (what to send, when to stop) belong to the supervisor
and the pure `pools` and `decisions` modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from pepsi.dispatch.policy.decisions import Exit, WorkerFacts
from pepsi.dispatch.policy.pools import WorkerLoad, room_for
from pepsi.protocol import (
    Answer,
    ProtocolError,
    encode_ids,
    is_ready,
    parse_status,
    takes_rows,
)

log = logging.getLogger("pepsi.dispatch")

READ_CHUNK = 65536  # bytes read from a child's stdout at once
MAX_LINE = 65536  # a longer status line is unreadable: the child is torn down


class WorkerProcess:
    """A running child `PROGRAM [-c FILE] worker` for one stage."""

    def __init__(
        self,
        key: int,
        stage: str,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        on_ready: Callable[[WorkerProcess], None],
        on_statuses: Callable[[WorkerProcess, list[Answer]], None],
        on_answers: Callable[[WorkerProcess, float], None],
        on_exit: Callable[[WorkerProcess, Exit], None],
        kill_grace: float,  # WORKER_KILL_GRACE
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = key
        self.stage = stage
        self.argv = list(argv)
        self.env = env
        self.inflight: deque[int] = deque()
        self.ready = False
        self.takes_rows = False  # said "ready rows": an id may carry its row
        self.handled = 0
        self.stopping = False
        self.timed_out = False  # killed for exceeding MAX_RUNTIME
        self.solo = False  # running one isolated suspect: takes nothing else
        self.garbled = False  # its answer for the head message was unreadable
        self.last_words: str | None = None
        self.clock = clock
        self.kill_grace = kill_grace  # seconds between SIGTERM and SIGKILL at shutdown
        self.started_at = clock()
        self.idle_since: float | None = self.started_at
        self.head_since: float | None = None  # when the head id reached the head
        self._answer_seconds = 0.0  # of the answers in the chunk being read
        self._answers = 0
        self._on_ready = on_ready
        self._on_statuses = on_statuses
        self._on_answers = on_answers
        self._on_exit = on_exit
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stderr_task: asyncio.Task[None] | None = None
        self._failure: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def facts(self) -> WorkerFacts:
        return WorkerFacts(
            self.key,
            ready=self.ready,
            stopping=self.stopping,
            started_at=self.started_at,
            inflight=len(self.inflight),
            head_since=self.head_since,
            idle_since=self.idle_since,
            handled=self.handled,
        )

    def load(self, window: int, max_messages: int) -> WorkerLoad:
        room = (
            0
            if self.stopping or self.solo
            else room_for(len(self.inflight), self.handled, window, max_messages)
        )
        return WorkerLoad(
            self.key, len(self.inflight), room, idle_since=self.idle_since, ready=self.ready
        )

    async def start(self, ids: Sequence[int]) -> None:
        """Spawn the child and hand it its first ids (buffered until it reads them)."""
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            start_new_session=True,  # a Ctrl-C to the dispatcher is not the children's
        )
        self.send(ids)
        loop = asyncio.get_running_loop()
        self._stderr_task = loop.create_task(self._relay_stderr())
        self._task = loop.create_task(self._read())

    def send(self, ids: Sequence[int], rows: Mapping[int, bytes] | None = None) -> None:
        """Write ids to the child's stdin in one buffer, with the `rows` given if the child
        takes them."""
        if not ids:
            return
        if not self.inflight:
            self.head_since = self.clock()
        self.inflight.extend(ids)
        self.idle_since = None
        stdin = self._proc.stdin if self._proc is not None else None
        if stdin is None or stdin.is_closing():
            return  # the reader will report the exit and these ids as unanswered
        with contextlib.suppress(ConnectionError):
            stdin.write(encode_ids(ids, rows if self.takes_rows else None))

    def close_input(self) -> None:
        """Ask the child to finish: it exits when its stdin closes."""
        self.stopping = True
        if self._proc and self._proc.stdin and not self._proc.stdin.is_closing():
            self._proc.stdin.close()

    def kill(self, reason: str, *, expected: bool = False) -> None:
        """Tear the child down now (protocol error, hang; or a stop it ignored)."""
        if not expected:
            self._failure = self._failure or reason
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; wait until it is gone."""
        self.stopping = True
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.kill_grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _relay_stderr(self) -> None:
        """The child's stderr goes to the dispatcher's; its last line is kept."""
        assert self._proc is not None
        assert self._proc.stderr is not None
        while line := await self._proc.stderr.readline():
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            text = line.decode("utf-8", "replace").strip()
            if text:
                self.last_words = text[:500]

    async def _read(self) -> None:
        """Read the child's answers a chunk at a time: a batch's lines cost one read."""
        assert self._proc is not None
        assert self._proc.stdout is not None
        stdout = self._proc.stdout
        pending = b""
        try:
            while chunk := await stdout.read(READ_CHUNK):
                *lines, pending = (pending + chunk).split(b"\n")
                if len(pending) > MAX_LINE:
                    raise ProtocolError("status line too long")
                self._lines(lines)
                if self._answers:  # the pace of what this read answered
                    self._on_answers(self, self._answer_seconds / self._answers)
                    self._answer_seconds, self._answers = 0.0, 0
            if pending:
                self._lines([pending])  # a last line without its newline
        except ProtocolError as exc:
            self.garbled = self.ready and bool(self.inflight)
            self.kill(str(exc))
        returncode = await self._proc.wait()
        if self._stderr_task is not None:
            # a grandchild may keep stderr open: do not wait for it forever
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(self._stderr_task, 2.0)
        self._finish(returncode)

    def _lines(self, lines: list[bytes]) -> None:
        """A read's lines, its answers handed over at once (one wakeup, one count each):
        those read before an unreadable line too, before the worker is torn down."""
        answers: list[Answer] = []
        try:
            for line in lines:
                if self.ready:
                    answers.append(self._status(line))
                else:
                    self._ready_line(line)
        finally:
            if answers:
                self._on_statuses(self, answers)

    def _ready_line(self, line: bytes) -> None:
        if is_ready(line):
            self.ready = True
            self.takes_rows = takes_rows(line)
            if self.inflight:  # MAX_RUNTIME counts from here, not from spawn
                self.head_since = self.clock()
            self._on_ready(self)
        else:
            raise ProtocolError(f"expected 'ready', got {line[:80]!r}")

    def _status(self, line: bytes) -> Answer:
        status = parse_status(line)  # ProtocolError: unreadable, tear down
        if not self.inflight:
            raise ProtocolError(f"status line with no message outstanding: {line[:80]!r}")
        wid = self.inflight.popleft()
        self.handled += 1
        now = self.clock()
        if self.head_since is not None:
            self._answer_seconds += now - self.head_since
        self._answers += 1
        self.head_since = now if self.inflight else None
        if not self.inflight:
            self.idle_since = now
            self.solo = False
        return wid, status

    def _finish(self, returncode: int) -> None:
        if self._failure:
            reason = self._failure
        elif returncode < 0:
            reason = f"killed by signal {-returncode}"
        else:
            reason = f"exited with status {returncode}"
        unanswered = tuple(self.inflight)
        self.inflight.clear()
        self._on_exit(
            self,
            Exit(
                returncode,
                self.ready,
                self.stopping and not self._failure,
                reason,
                unanswered,
                self.last_words,
                solo=self.solo,
                garbled=self.garbled,
                timed_out=self.timed_out,
            ),
        )


def resolve_program(program: str) -> str:
    """PROGRAM as given if absolute, else found on PATH (FileNotFoundError if not)."""
    if os.path.isabs(program):  # noqa: PTH117  # a string is what exec wants
        return program
    import shutil  # noqa: PLC0415

    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"{program}: not found on PATH")
    return found
