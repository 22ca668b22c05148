"""The condition language of `pepsi-stage-if`: parse once, evaluate per message (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pepsi.stages.condition import (
    MAX_DEPTH,
    And,
    Compare,
    Const,
    Field,
    Not,
    Or,
    Truthy,
    parse_condition,
    render,
)
from pepsi.stages.evaluation import evaluate
from pepsi.testing import make_message


def holds(text: str, **fields: Any) -> bool:
    return evaluate(parse_condition(text), make_message(**fields))


def test_tree_shape() -> None:
    cond = parse_condition("not state.seen or sender == 'x' and state.n > 1")
    assert cond == Or(
        (
            Not(Truthy(Field("state", ("seen",)))),
            And(
                (
                    Compare("==", Field("sender"), Const("x")),
                    Compare(">", Field("state", ("n",)), Const(1)),
                )
            ),
        )
    )
    assert parse_condition("(state.a or state.b) and state.c") == And(
        (Or((Truthy(Field("state", ("a",))), Truthy(Field("state", ("b",))))),
         Truthy(Field("state", ("c",))))
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "fields", "expected"),
    [
        ('sender == "a@example.org"', {"sender": "a@example.org"}, True),
        ('sender != "a@example.org"', {"sender": "b@example.org"}, True),
        (r'sender ~ "@example\.org$"', {"sender": "a@example.org"}, True),
        (r'sender matches "@example\.org$"', {"sender": "a@example.com"}, False),
        (r'sender !~ "@example\.org$"', {"sender": "a@example.com"}, True),
        ('subject ~ "(?i)^urgent"', {"subject": "URGENT: now"}, True),
        ('recipients ~ "@b\\.org$"', {"recipients": ["x@a.org", "y@b.org"]}, True),
        ('recipients == "x@a.org"', {"recipients": ["x@a.org", "y@b.org"]}, True),
        ('"y@b.org" in recipients', {"recipients": ["x@a.org", "y@b.org"]}, True),
        ('"z@b.org" not in recipients', {"recipients": ["x@a.org"]}, True),
        ('properties.kind in ["order", "refund"]', {"properties": {"kind": "refund"}}, True),
        ('properties.kind in ["order", "refund"]', {"properties": {}}, False),
        ("properties.a.b == 2", {"properties": {"a": {"b": 2}}}, True),
        ("properties.a.b == 2", {"properties": {"a": 5}}, False),
        ('"spam" in subject', {"subject": "no spam here"}, True),
        ('"kind" in properties', {"properties": {"kind": 1}}, True),
        ("state.score >= 5", {"state": {"score": 5}}, True),
        ("state.score >= 5", {"state": {"score": "9"}}, False),  # no string-number mixing
        ("state.score == 5", {"state": {"score": 5.0}}, True),
        ("state.flag == 1", {"state": {"flag": True}}, False),  # true is not 1
        ("state.flag", {"state": {"flag": True}}, True),
        ("state.flag", {"state": {"flag": 0}}, False),
        ("not state.missing", {}, True),
        ("state.missing == null", {}, True),
        ("origin_user == 'svc' AND NOT state.seen", {"origin_user": "svc"}, True),
        ("content_type == 'application/json'", {"content_type": "application/json"}, True),
        ("stage == 'check'", {"stage": "check"}, True),
        ("subject < 'b'", {"subject": "a"}, True),
        ("subject < 3", {"subject": "a"}, False),
        ("sender == 'x' or (state.n > 1 and state.n < 3)", {"state": {"n": 2}}, True),
    ],
)
def test_evaluation(text: str, fields: dict[str, Any], expected: bool) -> None:
    assert holds(text, **fields) is expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "must not be empty"),
        ("sender ==", "column 10: expected a field"),
        ("sender = 'x'", "column 8: unexpected '='"),
        ("bogus == 1", "unknown field 'bogus'"),
        ("sender.x == 1", "sender has no .x"),
        ("sender ~ subject", "takes a quoted regular expression"),
        ("sender ~ '('", "bad regular expression"),
        ("'open", "string not closed"),
        ("(sender", "expected ')'"),
        ("sender == 'x' sender", "expected and, or, or the end"),
        ("x in [1, [2]]", "unknown field 'x'"),
        ("sender in [1, sender]", "a list holds literals"),
        ("sender in [1 2]", "expected ',' or ']'"),
        ("not " * (MAX_DEPTH + 1) + "sender", "nested more than"),
        ("(" * (MAX_DEPTH + 1) + "sender" + ")" * (MAX_DEPTH + 1), "nested more than"),
        ("and", "expected a field"),
    ],
)
def test_errors_are_one_line_with_a_column(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_condition(text)
    assert problem in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------
# Properties.

FIELD_NAMES = st.sampled_from(
    ["sender", "subject", "recipients", "origin_user", "content_type", "stage"]
)
PATHS = st.builds(
    lambda base, keys: ".".join([base, *keys]),
    st.sampled_from(["properties", "state"]),
    st.lists(st.from_regex(r"[a-z_][a-z0-9_-]{0,5}", fullmatch=True), min_size=1, max_size=2),
)
STRINGS = st.text(st.characters(blacklist_categories=["Cs"]), max_size=8).map(
    lambda s: render(Truthy(Const(s)))
)
NUMBERS = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.floats(-1e6, 1e6, allow_nan=False).map(lambda f: render(Truthy(Const(f)))),
)
LITERALS = st.one_of(STRINGS, NUMBERS, st.sampled_from(["true", "false", "null"]))
OPERANDS = st.one_of(FIELD_NAMES, PATHS, LITERALS)
REGEXES = st.sampled_from(["a", "^x", "@b\\.org$", "(?i)urgent", ".*", ""]).map(
    lambda s: render(Truthy(Const(s)))
)
LISTS = st.lists(LITERALS, max_size=3).map(lambda items: "[" + ", ".join(items) + "]")


def comparison() -> st.SearchStrategy[str]:
    return st.one_of(
        OPERANDS,
        st.tuples(OPERANDS, st.sampled_from(["==", "!=", "<", "<=", ">", ">="]), OPERANDS).map(
            " ".join
        ),
        st.tuples(OPERANDS, st.sampled_from(["~", "!~", "matches"]), REGEXES).map(" ".join),
        st.tuples(OPERANDS, st.sampled_from(["in", "not in"]), st.one_of(OPERANDS, LISTS)).map(
            " ".join
        ),
    )


CONDITIONS = st.recursive(
    comparison(),
    lambda inner: st.one_of(
        inner.map(lambda c: f"not {c}"),
        inner.map(lambda c: f"({c})"),
        st.tuples(inner, st.sampled_from(["and", "or", "AND", "Or"]), inner).map(" ".join),
    ),
    max_leaves=12,
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
MESSAGES = st.builds(
    lambda sender, subject, recipients, properties, state: make_message(
        sender=sender,
        subject=subject,
        recipients=recipients,
        properties=properties,
        state=state,
    ),
    st.none() | st.text(max_size=10),
    st.none() | st.text(max_size=10),
    st.lists(st.text(max_size=8), max_size=3),
    st.dictionaries(st.from_regex(r"[a-z_]{1,3}", fullmatch=True), JSON, max_size=4),
    st.dictionaries(st.from_regex(r"[a-z_]{1,3}", fullmatch=True), JSON, max_size=4),
)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=80))
def test_any_text_parses_or_raises_value_error(text: str) -> None:
    try:
        cond = parse_condition(text)
    except ValueError as exc:
        problem = str(exc)
    else:
        assert parse_condition(render(cond)) == cond
        return
    assert problem
    assert "\n" not in problem


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="()notandr \"'\\[],~=!<>in0123456789.sender-state", max_size=60))
def test_near_grammar_text_parses_or_raises_value_error(text: str) -> None:
    problem = ""
    try:
        parse_condition(text)
    except ValueError as exc:
        problem = str(exc)
    assert "\n" not in problem


@settings(max_examples=300, deadline=None)
@given(CONDITIONS, MESSAGES)
def test_grammar_conditions_parse_render_back_and_evaluate(text: str, msg: Any) -> None:
    cond = parse_condition(text)
    assert parse_condition(render(cond)) == cond
    result = evaluate(cond, msg)
    assert result is True or result is False
    assert evaluate(Not(cond), msg) is (not result)
