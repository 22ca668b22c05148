"""What a stage's result does to its message's row (W-2, W-3). Pure, clock injected.

The runner hands over what the stage returned (`after_return`) or raised
(`after_raise`), the message as the stage left it, and the state as it was
loaded (JSON text); back comes one `Decision`: the row's next stage, status,
state and timeout, or its deletion, with the word the status line's report
carries and, after a failure, the error to log. The stage's timings come
from its configuration (`msg.options`), the only source of their defaults.

- `None` or `Advance()`: pending at NEXT (or at `Advance.to`); finished
  (deleted) when there is no NEXT. `strikes` and `temporary_failures` start
  again at a new stage.
- `Finish()`: deleted. `Pause(until, reason)`: paused until `until`.
- A state that is not a JSON object cannot be written: the loaded one is
  kept, and on the success path that is the stage's error (a host failure).
- `PermanentError`: failed at once (`failure_class` = permanent).
- Any other exception, an Advance to an unknown stage or a value that is not
  an outcome is a host failure: paused and retried after RETRY_DELAY,
  doubling up to RETRY_MAX_DELAY, until the message has been in the system
  longer than MAX_LIFETIME; then it goes on to BOUNCE_STAGE, or fails
  (`failure_class` = retries-exhausted).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from pepsi.config.values import is_amqp_stage, stage_ref
from pepsi.stage import (
    Advance,
    Defer,
    Fail,
    Finish,
    Message,
    NewMessage,
    Part,
    Pause,
    PermanentError,
    Split,
)
from pepsi.worker.edits import COLUMNS, Edits, check

Clock = Callable[[], datetime]
ERROR_LIMIT = 2000  # characters of an error kept in state.last_error
PER_STAGE = ("strikes", "temporary_failures")  # counts that start again at each stage
RETRIES_EXHAUSTED = "retries-exhausted"  # state.failure_class past MAX_LIFETIME


class Decision(NamedTuple):
    """One row's update after its stage ran (a tuple: it is built once per message)."""

    outcome: str  # the report's word: advance, finish, pause, retry or fail
    stage: str | None = None  # the row's next stage; None: the row is deleted (finished)
    status: str | None = None  # the row's next status: pending, paused or failed
    state: dict[str, Any] | None = None
    timeout: datetime | None = None
    error: str | None = None  # a failure as logged (state.last_error has it truncated)
    fuse: bool = True  # an advance the stage let be fused (W-10)
    edits: Edits | None = None  # what the stage changed in the message (issue 32)
    # A Split: each group of recipients with its own decision, and the messages made.
    parts: tuple[tuple[tuple[str, ...], Decision], ...] | None = None
    spawn: tuple[NewMessage, ...] = ()

    @property
    def exit_status(self) -> int:
        """The status line's status: 1 for a failed message, else 0."""
        return 1 if self.status == "failed" else 0

    def row(self, workqueue_id: int) -> dict[str, Any]:
        """The update as `workqueue_record_outcomes` reads it (one JSON object)."""
        row = {
            "workqueue_id": workqueue_id,
            "stage": self.stage,
            "status": self.status,
            "timeout": self.timeout.isoformat() if self.timeout else None,
            "state": self.state,
        }
        if self.edits is not None:
            row["edits"] = self.edits.columns
        return row


FINISH = Decision("finish")
ADVANCE = Advance()  # what a stage returning None means


def retry_delay(failures: int, first: float, cap: float) -> float:
    """Seconds before retry number `failures`: first, 2 × first, 4 × first … ≤ cap."""
    return min(cap, first * 2.0 ** max(0, min(failures - 1, 30)))


def _advance_target(target: str, stages: Container[str]) -> tuple[str, str | None]:
    """The stage an advance goes to (an AMQP queue's in its full form), or a problem."""
    if is_amqp_stage(target):  # amqp:QUEUE or amqp:VHOST:QUEUE
        try:
            return stage_ref(target), None
        except ValueError as error:
            return target, f"advance: {error}"
    if target not in stages:
        return target, f"advance to unknown stage {target!r}"
    return target, None


def after_return(
    result: object, msg: Message, loaded_state: str, stages: Container[str], now: Clock
) -> Decision:
    """The decision for what the stage returned; `stages` are those it may advance to."""
    state = msg.state
    if type(state) is not dict or state:  # an empty dict (the common case) is JSON as it is
        problem = _state_problem(state)
        if problem is not None:
            return _host_failure(msg, json.loads(loaded_state), f"TypeError: {problem}", now)
    return _decision(result, msg, state, stages, now)


def _decision(  # noqa: PLR0911  # one return per outcome reads best
    result: object, msg: Message, state: dict[str, Any], stages: Container[str], now: Clock
) -> Decision:
    """As `after_return`, for a state known to be writable."""
    if result is None:
        result = ADVANCE
    match result:
        case Advance(to=to, fuse=fuse):
            target = to or msg.options.next
            if target is None:
                return FINISH
            target, problem = _advance_target(target, stages)
            if problem is not None:
                return _host_failure(msg, state, problem, now)
            if target != msg.stage and ("strikes" in state or "temporary_failures" in state):
                state = {k: v for k, v in state.items() if k not in PER_STAGE}
            return Decision("advance", target, "pending", state, fuse=fuse)
        case Finish():
            return FINISH
        case Pause(until=until, reason=reason) if until is None or isinstance(until, datetime):
            if reason:
                state = {**state, "pause_reason": reason}
            return Decision("pause", msg.stage, "paused", state, until)
        case Split():
            return _split(result, msg, state, stages, now)
        case _:
            return _host_failure(msg, state, f"stage returned {result!r}, not an outcome", now)


def _split(
    split: Split, msg: Message, state: dict[str, Any], stages: Container[str], now: Clock
) -> Decision:
    """Each part's decision; the row's own is the first part's that is not finished."""
    parts = [p for p in split.parts if isinstance(p, Part) and p.recipients]
    named = sorted(r for part in parts for r in part.recipients)
    if len(parts) != len(split.parts) or named != sorted(msg.recipients):
        return _host_failure(msg, state, _PARTS_PROBLEM, now)
    spawn, problem = _spawned(split.spawn, stages)
    if problem is not None:
        return _host_failure(msg, state, problem, now)
    decided = tuple(
        (tuple(part.recipients), _part(part.outcome, msg, state, stages, now)) for part in parts
    )
    if len(decided) == 1 and not spawn:
        return decided[0][1]  # one group: an ordinary outcome
    row = next((d for _, d in decided if d.stage is not None), FINISH)
    return row._replace(parts=decided, spawn=spawn, error=None)


def _part(
    outcome: object, msg: Message, state: dict[str, Any], stages: Container[str], now: Clock
) -> Decision:
    match outcome:
        case Defer(reason=reason):
            return _host_failure(msg, state, reason, now)
        case Fail(reason=reason):
            return _permanent(msg, state, reason)
        case Advance() | Finish() | Pause():
            return _decision(outcome, msg, state, stages, now)
    return _host_failure(msg, state, f"split part {outcome!r} is not an outcome", now)


_PARTS_PROBLEM = "split: the parts must name each of the message's recipients once"
# what a NewMessage carries of the columns a stage may edit (it has no correlation id)
_NEW_MESSAGE_COLUMNS = tuple(name for name in COLUMNS if name != "correlation_id")


def _spawned(
    spawn: Sequence[object], stages: Container[str]
) -> tuple[tuple[NewMessage, ...], str | None]:
    """The new messages, each to its stage's full name (an AMQP queue's); or a problem."""
    made: list[NewMessage] = []
    for new in spawn:
        if not isinstance(new, NewMessage):
            return (), f"split: spawn holds {new!r}, not a NewMessage"
        target, problem = _advance_target(new.stage, stages)
        if problem is not None:
            return (), f"split: new message to stage {target!r}: {problem}"
        problem = _state_problem(new.state)
        try:
            for name in _NEW_MESSAGE_COLUMNS:
                check(name, getattr(new, name))
        except (TypeError, ValueError) as exc:
            problem = str(exc)
        if problem is not None:
            return (), f"split: new message: {problem}"
        made.append(replace(new, stage=target))
    return tuple(made), None


def after_raise(exc: Exception, msg: Message, loaded_state: str, now: Clock) -> Decision:
    """The decision for what the stage raised: PermanentError fails, the rest retries.

    A state the stage left unwritable is replaced by the loaded one quietly:
    the stage's own error is the one recorded.
    """
    state = msg.state
    if _state_problem(state) is not None:
        state = json.loads(loaded_state)
    if isinstance(exc, PermanentError):
        return _permanent(msg, state, str(exc))
    return _host_failure(msg, state, f"{type(exc).__name__}: {exc}", now)


def _permanent(msg: Message, state: dict[str, Any], error: str) -> Decision:
    new_state = {
        **state,
        "last_error": _error_text(error or "permanent"),
        "failed_stage": msg.stage,
        "failure_class": "permanent",
    }
    return Decision("fail", msg.stage, "failed", new_state, error=error)


def _state_problem(state: object) -> str | None:
    """Why `state` cannot be written to the row; None if it can."""
    if not isinstance(state, dict):
        return f"state is not a JSON object but {type(state).__name__}"
    try:
        json.dumps(state, allow_nan=False)  # jsonb has no NaN
    except (TypeError, ValueError) as exc:
        return f"state is not JSON: {exc}"
    return None


def _host_failure(msg: Message, state: dict[str, Any], error: str, now: Clock) -> Decision:
    options = msg.options
    failures = int(state.get("temporary_failures", 0)) + 1
    new_state = {**state, "last_error": _error_text(error), "temporary_failures": failures}
    moment = now()
    if moment - msg.arrived > timedelta(seconds=options.max_lifetime):
        new_state["failed_stage"] = msg.stage
        new_state["failure_class"] = RETRIES_EXHAUSTED
        if options.bounce_stage is not None:
            return Decision("advance", options.bounce_stage, "pending", new_state, error=error)
        return Decision("fail", msg.stage, "failed", new_state, error=error)
    delay = retry_delay(failures, options.retry_delay, options.retry_max_delay)
    until = moment + timedelta(seconds=delay)
    return Decision("retry", msg.stage, "paused", new_state, until, error)


def _error_text(error: str) -> str:
    return error if len(error) <= ERROR_LIMIT else error[: ERROR_LIMIT - 1] + "…"
