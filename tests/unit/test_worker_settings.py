"""Per-address settings (W-9): parsing, overlay, grouping and the recheck, without a database."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.config import StageConfig
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.worker.settings import (
    PER_MESSAGE,
    OverrideCheck,
    normalise_address,
    overlay,
    parse_option,
    parse_overrides,
    plan,
)

STAGE = StageConfig(name="a", handler="x:y", next="b", retry_delay=60.0)
STAGES = {"a", "b", "dead"}


BUILTINS = parse_config(
    parse_ini(
        "[stage-a]\nHANDLER = x:y\nNEXT = b\n[stage-b]\nHANDLER = x:y\n"
        "[stage-dead]\nHANDLER = x:y\n"
        "[stage-tag]\nPROGRAM = pepsi-stage-set\nSET = seen=yes\n"
        '[stage-route]\nPROGRAM = pepsi-stage-if\nIF = sender ~ "@vip\\.org$"\nTHEN = a\n'
        "ELSE = b\n"
        "[stage-sign]\nPROGRAM = pepsi-stage-dkim-sign\nDOMAIN = example.org\n"
        "SELECTOR = s1\nKEY_FILE = /etc/keys/s1.pem\n"
        "[stage-out]\nPROGRAM = pepsi-stage-relay-to-smarthost\nHOST = relay.example.org\n"
        "TLS = none\n",
        "test",
    )
).stages
ALL = set(BUILTINS)


def test_every_stage_may_override_its_failure_timing_and_dead_letter_route() -> None:
    assert set(PER_MESSAGE) == {"MAX_LIFETIME", "RETRY_DELAY", "RETRY_MAX_DELAY", "BOUNCE_STAGE"}


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("RETRY_DELAY", "10s", ("retry_delay", 10.0)),
        ("retry_delay", "2m", ("retry_delay", 120.0)),
        ("MAX_LIFETIME", "1h", ("max_lifetime", 3600.0)),
        ("BOUNCE_STAGE", "dead", ("bounce_stage", "dead")),
    ],
)
def test_parse_option(key: str, value: str, expected: tuple[str, object]) -> None:
    assert parse_option(key, value, STAGE, STAGES) == expected


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("NEXT", "b", "NEXT cannot be set per address: it shapes the stage graph"),
        ("HANDLER", "a:b", "HANDLER cannot be set per address: it shapes the stage graph"),
        ("PARALLELISM", "2", "PARALLELISM cannot be set per address: it acts on the stage's wo"),
        ("MAX_LENGTH", "2", "MAX_LENGTH cannot be set per address: it acts on the stage's queue"),
        ("COLOUR", "red", "unknown key COLOUR for [stage-a] (per address: MAX_LIFETIME, "),
        ("SET", "a=1", "unknown key SET for [stage-a]"),  # a built-in's key, not a's
        ("RETRY_DELAY", "soon", "RETRY_DELAY: "),
        ("BOUNCE_STAGE", "nowhere", "BOUNCE_STAGE: no stage named 'nowhere'"),
        ("BOUNCE_STAGE", "Bad Name", "BOUNCE_STAGE: "),
    ],
)
def test_parse_option_refuses(key: str, value: str, problem: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(problem)) as info:
        parse_option(key, value, STAGE, STAGES)
    assert "\n" not in str(info.value)


def test_stored_options_that_no_longer_fit_are_a_problem_not_a_quiet_skip() -> None:
    parsed, problem = parse_overrides({"RETRY_DELAY": "5s", "BOUNCE_STAGE": "gone"}, STAGE, STAGES)
    assert (parsed, problem) == ((), "BOUNCE_STAGE: no stage named 'gone'")
    assert parse_overrides({"RETRY_DELAY": "5s"}, STAGE, STAGES) == ((("retry_delay", 5.0),), None)


def test_a_builtins_own_keys_are_laid_over_its_section_and_built_again() -> None:
    tag, route, sign = BUILTINS["tag"], BUILTINS["route"], BUILTINS["sign"]
    parsed, problem = parse_overrides({"SET": "seen=no, vip=true"}, tag, ALL)
    assert problem is None
    assert overlay(tag, parsed).builtin_options.values == (("seen", "no"), ("vip", True))
    parsed, _ = parse_overrides({"SELECTOR": "s2", "KEY_FILE": "/etc/keys/s2.pem"}, sign, ALL)
    signed = overlay(sign, parsed).builtin_options
    assert (signed.domain, signed.selector, str(signed.key_file)) == (
        "example.org",
        "s2",
        "/etc/keys/s2.pem",
    )
    parsed, _ = parse_overrides({"THEN": "dead"}, route, ALL)
    assert overlay(route, parsed).builtin_options.routes == (("THEN", "dead"), ("ELSE", "b"))
    # the combination must build, and name stages that are there
    assert parse_overrides({"THEN": "nowhere"}, route, ALL)[1] == "THEN: no stage named 'nowhere'"
    assert parse_overrides({"THEN": "route"}, route, ALL)[1] == (
        "THEN: an if stage cannot route to itself (messages would loop)"
    )
    out = BUILTINS["out"]
    assert parse_overrides({"AUTH_USER": "bob"}, out, ALL)[1] == (
        "AUTH_USER: set AUTH_USER and AUTH_SECRET_FILE together"
    )
    assert parse_overrides({"HOST": "other.example.net"}, out, ALL)[1] is None


def test_overlay() -> None:
    assert overlay(STAGE, ()) is STAGE
    changed = overlay(STAGE, (("bounce_stage", "dead"), ("retry_delay", 1.0)))
    assert (changed.retry_delay, changed.bounce_stage, changed.next) == (1.0, "dead", "b")


@pytest.mark.parametrize("good", ["Alice@Example.ORG", " bob@x ", "postmaster"])
def test_normalise_address(good: str) -> None:
    assert normalise_address(good) == good.strip().lower()


@pytest.mark.parametrize("bad", ["", "  ", "a b@x", "a@b@c", "@x", "a@", "x\x00@y", "a" * 321])
def test_normalise_address_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="not an address"):
        normalise_address(bad)


def test_no_override_is_one_group_with_the_stage_as_it_is() -> None:
    result = plan(STAGE, ["a@x", "b@x"], "s@y", {}, overrides=None, stages=STAGES)
    assert result.groups == (("a@x", "b@x"),)
    assert result.options == (STAGE,)
    assert not result.split


def test_one_override_shared_by_every_recipient_is_no_split() -> None:
    overrides = {"a@x": {"RETRY_DELAY": "5s"}, "b@x": {"retry_delay": "5"}}
    result = plan(STAGE, ["A@x", "b@x"], None, {}, overrides=overrides, stages=STAGES)
    assert result.groups == (("A@x", "b@x"),)
    assert result.options[0].retry_delay == 5.0


def test_diverging_recipients_are_grouped_first_group_first() -> None:
    overrides = {"b@x": {"RETRY_DELAY": "5s"}, "d@x": {"RETRY_DELAY": "5s"}, "c@x": {"TTL": "1"}}
    result = plan(STAGE, ["a@x", "b@x", "c@x", "d@x"], None, {}, overrides=overrides, stages=STAGES)
    # c@x's option cannot be used (written by hand, or the configuration changed): its own
    # group, which fails; the others run
    assert result.groups == (("a@x",), ("b@x", "d@x"), ("c@x",))
    assert [o.retry_delay for o in result.options] == [60.0, 5.0, 60.0]
    assert result.split
    assert result.errors == (
        None,
        None,
        "TTL cannot be set per address: it acts on the stage's queue as a whole",
    )
    assert result.error is None  # the row's own group runs


def test_a_domains_entry_applies_to_its_addresses_under_their_own() -> None:
    sign = BUILTINS["sign"]
    overrides = {
        "partner.org": {"SELECTOR": "partner", "KEY_FILE": "/etc/keys/partner.pem"},
        "boss@partner.org": {"SELECTOR": "boss"},
    }
    result = plan(sign, ["a@x"], "Ann@Partner.org", {"local_origin": True},
                  overrides=overrides, stages=ALL)  # fmt: skip
    assert result.options[0].builtin_options.selector == "partner"
    result = plan(sign, ["a@x"], "boss@partner.org", {"local_origin": True},
                  overrides=overrides, stages=ALL)  # fmt: skip
    options = result.options[0].builtin_options
    assert (options.selector, str(options.key_file)) == ("boss", "/etc/keys/partner.pem")
    out = BUILTINS["out"]  # a smarthost per recipient domain: the message splits by it
    result = plan(out, ["a@x.org", "b@slow.net", "c@x.org"], None, {},
                  overrides={"slow.net": {"HOST": "slow-relay.example.org"}}, stages=ALL)  # fmt: skip
    assert result.groups == (("a@x.org", "c@x.org"), ("b@slow.net",))
    assert [o.builtin_options.host for o in result.options] == [
        "relay.example.org",
        "slow-relay.example.org",
    ]


def test_local_origin_takes_the_senders_options_and_never_splits() -> None:
    overrides = {"s@y": {"MAX_LIFETIME": "1m"}, "b@x": {"RETRY_DELAY": "5s"}}
    state = {"local_origin": True}
    result = plan(STAGE, ["a@x", "b@x"], "S@y", state, overrides=overrides, stages=STAGES)
    assert result.groups == (("a@x", "b@x"),)
    assert (result.options[0].max_lifetime, result.options[0].retry_delay) == (60.0, 60.0)


ADDRESSES = st.sampled_from([f"u{i}@x" for i in range(8)])
OPTIONS = st.sampled_from([{}, {"RETRY_DELAY": "5s"}, {"RETRY_DELAY": "5"}, {"MAX_LIFETIME": "1h"}])


@given(st.lists(ADDRESSES, max_size=12), st.dictionaries(ADDRESSES, OPTIONS))
def test_every_recipient_ends_in_exactly_one_group(
    recipients: list[str], overrides: dict[str, dict[str, str]]
) -> None:
    result = plan(STAGE, recipients, None, {}, overrides=overrides, stages=STAGES)
    flat = [r for group in result.groups for r in group]
    assert Counter(flat) == Counter(recipients)
    assert len(result.groups) == len(result.options)
    assert all(result.groups) or recipients == []
    # Groups differ in their options; members of a group share them.
    assert len(set(result.options)) == len(result.options)
    for group, options in zip(result.groups, result.options, strict=True):
        for member in group:
            alone = plan(STAGE, [member], None, {}, overrides=overrides, stages=STAGES)
            assert alone.options == (options,)
    # The first group is the first recipient's: it stays on the row.
    if recipients:
        assert result.groups[0][0] == recipients[0]
        # A row that holds only its first group is never split again.
        again = plan(STAGE, result.groups[0], None, {}, overrides=overrides, stages=STAGES)
        assert not again.split


def test_override_check_asks_at_most_every_interval_while_there_is_none() -> None:
    now = [100.0]
    check = OverrideCheck(lambda: now[0], interval=5.0)
    assert check.due()
    check.record(False)
    assert not check.due()
    now[0] += 4.9
    assert not check.due()
    now[0] += 0.1
    assert check.due()
    check.record(True)
    now[0] += 100
    assert not check.due()  # known to exist: every load carries them and says when none remain
    assert check.exists
    check.record(False)
    assert not check.due()
