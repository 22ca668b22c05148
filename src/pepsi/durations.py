"""Durations in configuration values: `30s`, `5m`, `120h`, `1h30m`, `250ms`.

A bare number is seconds. Pure functions, no I/O.
"""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_BARE = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(text: str) -> float:
    """Return the duration `text` names, in seconds; ValueError if it names none."""
    value = text.strip().lower().replace(" ", "")
    if _BARE.fullmatch(value):
        return float(value)
    pos = 0
    total = 0.0
    seen: set[str] = set()
    for match in _PART.finditer(value):
        if match.start() != pos or match.group(2) in seen:
            break
        seen.add(match.group(2))
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    else:
        if pos == len(value) and pos > 0:
            return total
    raise ValueError(f"not a duration: {text!r} (examples: 30s, 5m, 120h, 1h30m)")


def format_duration(seconds: float) -> str:
    """Render seconds in the largest whole units, the inverse of parse_duration."""
    if seconds < 1 and seconds > 0:
        return f"{round(seconds * 1000)}ms"
    remaining = round(seconds)
    if remaining == 0:
        return "0s"
    parts = []
    for unit in ("d", "h", "m", "s"):
        size = int(_UNITS[unit])
        if remaining >= size:
            parts.append(f"{remaining // size}{unit}")
            remaining %= size
    return "".join(parts)


def format_seconds(seconds: float) -> str:
    """A delay for a log line: `500ms` under a second, else seconds (`60s`, `1.5s`).

    Log lines name delays in seconds as the docs do (`retry in 60s`); a
    sub-second delay must not round to a misleading `0s`.
    """
    if 0 < seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{round(seconds, 1):g}s"
