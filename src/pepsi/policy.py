"""What happens to a message after its stage fails (W-3). Pure, clock injected.

A host failure (any exception but PermanentError) pauses the message at the
stage it was claimed at and retries it after 1, 2, 4 … minutes, capped at an
hour, until it has been in the system longer than the stage's MAX_LIFETIME;
then it goes to the stage's BOUNCE_STAGE, or fails (retries-exhausted). A
permanent error fails it at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

RETRY_FIRST = 60.0
RETRY_CAP = 3600.0
ERROR_LIMIT = 2000  # characters of an error kept in state.last_error


def retry_delay(failures: int, first: float = RETRY_FIRST, cap: float = RETRY_CAP) -> float:
    """Seconds before retry number `failures` (1 → 1 min, 2 → 2 min, … ≤ 1 h)."""
    return min(cap, first * 2.0 ** max(0, min(failures - 1, 30)))


@dataclass(frozen=True)
class Decision:
    status: str  # the row's next status: pending (bounced), paused or failed
    stage: str  # the stage the row will be at
    state: dict[str, Any]
    timeout: datetime | None = None
    failure_class: str | None = None


def _error_text(error: str) -> str:
    return error if len(error) <= ERROR_LIMIT else error[: ERROR_LIMIT - 1] + "…"


def on_permanent_error(stage: str, state: dict[str, Any], error: str) -> Decision:
    new_state = {
        **state,
        "last_error": _error_text(error),
        "failed_stage": stage,
        "failure_class": "permanent",
    }
    return Decision("failed", stage, new_state, failure_class="permanent")


def on_host_failure(
    stage: str,
    state: dict[str, Any],
    error: str,
    *,
    arrived: datetime,
    now: datetime,
    max_lifetime: float,
    bounce_stage: str | None,
    first_delay: float = RETRY_FIRST,
    max_delay: float = RETRY_CAP,
) -> Decision:
    failures = int(state.get("temporary_failures", 0)) + 1
    new_state = {**state, "last_error": _error_text(error), "temporary_failures": failures}
    if now - arrived > timedelta(seconds=max_lifetime):
        new_state["failed_stage"] = stage
        new_state["failure_class"] = "retries-exhausted"
        if bounce_stage is not None:
            return Decision("pending", bounce_stage, new_state, failure_class="retries-exhausted")
        return Decision("failed", stage, new_state, failure_class="retries-exhausted")
    until = now + timedelta(seconds=retry_delay(failures, first_delay, max_delay))
    return Decision("paused", stage, new_state, timeout=until)
