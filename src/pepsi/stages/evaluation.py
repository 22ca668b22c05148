"""Evaluating a parsed condition against a message: pure, total (never raises).

A missing field is null; a comparison of values of different types is false;
on a list field `==` and `~` hold when one element does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

from pepsi.stages.condition import And, Compare, Condition, Const, Not, Operand, Or, Truthy


class Subject(Protocol):
    """What a condition reads: `pepsi.stage.Message` has these (and more)."""

    @property
    def properties(self) -> Mapping[str, Any]: ...
    @property
    def state(self) -> Mapping[str, Any]: ...


def evaluate(cond: Condition, msg: Subject) -> bool:
    """Whether `cond` holds for `msg`; never raises."""
    match cond:
        case Compare(op=op, left=left, right=right, pattern=pattern):
            return _compare(op, _value(left, msg), _value(right, msg), pattern)
        case Truthy(operand=operand):
            return _truthy(_value(operand, msg))
        case Not(operand=inner):
            return not evaluate(inner, msg)
        case And(operands=items):
            return all(evaluate(item, msg) for item in items)
        case Or(operands=items):
            return any(evaluate(item, msg) for item in items)


def _value(operand: Operand, msg: Subject) -> Any:
    if isinstance(operand, Const):
        return operand.value
    value: Any = getattr(msg, operand.name, None)
    for key in operand.path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return tuple(value) if isinstance(value, list) else value


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return value is not None and value not in (0, "", (), {})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but "1" != 1 and true != 1."""
    if _number(a) and _number(b):
        return bool(a == b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and not _number(a) and bool(a == b)


def _compare(op: str, left: Any, right: Any, pattern: re.Pattern[str] | None) -> bool:  # noqa: PLR0911
    many = isinstance(left, tuple) and not isinstance(right, tuple)
    match op:
        case "==":
            return any(_same(x, right) for x in left) if many else _same(left, right)
        case "!=":
            return not _compare("==", left, right, pattern)
        case "~":
            if pattern is None:
                return False
            items = left if isinstance(left, tuple) else (left,)
            return any(isinstance(x, str) and pattern.search(x) is not None for x in items)
        case "!~":
            return not _compare("~", left, right, pattern)
        case "in":
            return _contains(right, left)
        case "not in":
            return not _contains(right, left)
        case _:
            return _order(op, left, right)


def _contains(container: Any, item: Any) -> bool:
    if isinstance(item, tuple):
        return any(_contains(container, x) for x in item)
    if isinstance(container, str):
        return isinstance(item, str) and item in container
    if isinstance(container, tuple):
        return any(_same(item, x) for x in container)
    if isinstance(container, Mapping):
        return isinstance(item, str) and item in container
    return False


def _order(op: str, left: Any, right: Any) -> bool:
    numbers = _number(left) and _number(right)
    if not (numbers or (isinstance(left, str) and isinstance(right, str))):
        return False
    if op == "<":
        return bool(left < right)
    if op == "<=":
        return bool(left <= right)
    if op == ">":
        return bool(left > right)
    return bool(left >= right)
