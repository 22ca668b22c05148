"""The worker line protocol (W-1), both directions. Pure: bytes in, values out.

    dispatcher -> worker (stdin):   one message id per line, "123\\n"; to a worker
                                    that announced "ready rows", an id may carry
                                    its row after a space: "123 [...]\\n"
    worker -> dispatcher (stdout):  "ready\\n" (or "ready rows\\n") once, then one
                                    status line per id,
                                    in input order: "0" or a non-zero integer,
                                    optionally " " + a JSON report of the
                                    stages run in that pass:
                                    [["<stage>", <microseconds>(, "<outcome>")], ...]

The outcome (advance, finish, pause, retry, fail) is optional and only feeds
the per-stage counters; an outcome this build does not know is ignored, so a
newer worker costs an older dispatcher a counter, not the report.

Only an unreadable status is fatal (it desynchronises the positional
protocol); an unreadable report is dropped with a warning.

"ready rows" is Pepsi's own worker for a stage that reads only metadata: a
small claim hands it the rows it took (a JSON array, see
pepsi.workqueue_claimed_rows), so it runs them without a load of its own. A
program that answers plain "ready" only ever gets ids.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

READY = b"ready"
READY_ROWS = b"ready rows"
OUTCOMES = frozenset({"advance", "finish", "pause", "retry", "fail"})
_STATUS = re.compile(rb"(-?\d{1,9})(?: (.*))?")
# The line nearly every pass writes: one stage, its microseconds, maybe an
# outcome, in JSON that needs no decoder (no escapes, no leading zeros). Read
# by this pattern in a fifth of json.loads' time; anything else goes to it.
_ONE_PASS = re.compile(
    rb'(-?\d{1,9}) \[\["([^"\\\x00-\x1f]*)",(0|[1-9]\d{0,17})(?:,"([a-z]*)")?\]\]'
)


class ProtocolError(Exception):
    """A line the other side cannot have meant: the worker must be torn down."""


class Pass(NamedTuple):
    """One stage run in a worker pass, as its report names it."""

    stage: str
    micros: int
    outcome: str | None = None


class StatusLine(NamedTuple):
    """A worker's answer for one id (a tuple: one per message, made cheaply)."""

    status: int
    report: tuple[Pass, ...] | None = None  # None: no (readable) report
    report_error: str | None = None  # why a report present on the line was dropped

    @property
    def ok(self) -> bool:
        return self.status == 0


Answer = tuple[int, StatusLine]  # an id and the status line that answered it (in order)


def encode_ids(ids: Iterable[int], rows: Mapping[int, bytes] | None = None) -> bytes:
    """Ids for a worker's stdin, written in one buffer; with its row where `rows` has one."""
    if not rows:
        return b"".join(b"%d\n" % i for i in ids)
    return b"".join(b"%d %s\n" % (i, rows[i]) if i in rows else b"%d\n" % i for i in ids)


def parse_id_line(line: bytes) -> tuple[int, bytes | None]:
    """A message id line read by a worker: the id, and the row it carries or None."""
    text, _, row = line.strip().partition(b" ")
    if not text.isdigit():
        raise ProtocolError(f"not a message id: {line[:40]!r}")
    return int(text), row or None


def is_ready(line: bytes) -> bool:
    return line.strip() in (READY, READY_ROWS)


def takes_rows(ready_line: bytes) -> bool:
    """Whether a worker's ready line asked for rows with the ids."""
    return ready_line.strip() == READY_ROWS


def parse_status(line: bytes) -> StatusLine:
    """A status line read by the dispatcher; ProtocolError if the status is unreadable."""
    line = line.rstrip(b"\r\n")
    one = _ONE_PASS.fullmatch(line)
    if one is not None:
        status, stage, micros, outcome = one.groups()
        try:
            name, known = _names(stage, outcome)
        except UnicodeDecodeError:
            pass  # json.loads below says why
        else:
            return StatusLine(int(status), (Pass(name, int(micros), known),))
    match = _STATUS.fullmatch(line)
    if match is None:
        raise ProtocolError(f"unreadable status line: {line[:80]!r}")
    status = int(match.group(1))
    raw_report = match.group(2)
    if raw_report is None:
        return StatusLine(status)
    try:
        return StatusLine(status, _parse_report(json.loads(raw_report)))
    except (ValueError, TypeError) as exc:
        return StatusLine(status, None, f"unreadable report {raw_report[:80]!r}: {exc}")


@functools.lru_cache(maxsize=256)
def _names(stage: bytes, outcome: bytes | None) -> tuple[str, str | None]:
    """A one-pass line's stage and known outcome as text (a few pairs: cached)."""
    text = outcome.decode() if outcome is not None else None
    return stage.decode(), text if text in OUTCOMES else None


def _parse_report(value: object) -> tuple[Pass, ...]:
    if not isinstance(value, list):
        raise TypeError("a report is a JSON list")
    entries = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) not in (2, 3)
            or not isinstance(item[0], str)
            or not isinstance(item[1], int)
            or isinstance(item[1], bool)
            or item[1] < 0
            or (len(item) == 3 and not isinstance(item[2], str))
        ):
            raise TypeError(f"a report entry is [stage, microseconds, outcome?], got {item!r}")
        outcome = item[2] if len(item) == 3 and item[2] in OUTCOMES else None
        entries.append(Pass(item[0], item[1], outcome))
    return tuple(entries)


def format_status(status: int, report: Sequence[Pass] | None = None) -> bytes:
    """A status line written by a worker."""
    if report is None:
        return b"%d\n" % status
    return b"%d [%s]\n" % (status, b",".join(map(_entry, report)))


def _entry(p: Pass) -> bytes:
    """One stage's entry of a report: [stage, microseconds(, outcome)]."""
    outcome = b"," + _json_text(p.outcome) if p.outcome else b""
    return b"[%s,%d%s]" % (_json_text(p.stage), p.micros, outcome)


@functools.cache
def _json_text(text: str) -> bytes:
    """A stage name or outcome as a JSON string (few distinct values: cached)."""
    return json.dumps(text).encode()
