"""Exchanges, bindings and routing (pepsi.amqp.model: exchanges, topics, routing): RabbitMQ 3.x."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pepsi.amqp.model.exchanges import (
    DIRECT,
    EXCHANGE,
    FANOUT,
    HEADERS,
    QUEUE,
    TOPIC,
    Binding,
    Exchange,
    check_binding,
    check_exchange_declare,
    check_exchange_delete,
    check_exchange_type,
    check_redeclare,
    predeclared,
)
from pepsi.amqp.model.routing import RoutingTable, route, routing_keys
from pepsi.amqp.model.topics import (
    MAX_TOPIC_EXCHANGE_WORDS,
    MAX_TOPIC_WORDS,
    TopicMatcher,
    check_new_binding,
    topic_matches,
    topic_pattern,
    topic_words,
)
from pepsi.amqp.wire.replies import ACCESS_REFUSED, NOT_FOUND, PRECONDITION_FAILED, ChannelError

V = "/"


def q(source: str, queue: str, key: str = "", **arguments: object) -> Binding:
    return Binding(source, queue, QUEUE, key, arguments)


def x2x(source: str, destination: str, key: str = "") -> Binding:
    return Binding(source, destination, EXCHANGE, key)


def ex(name: str, kind: str = DIRECT, **options: object) -> Exchange:
    return Exchange(V, name, kind, **options)  # type: ignore[arg-type]


# -- values ----------------------------------------------------------------------------


def test_exchange_and_binding_are_frozen_and_hashable() -> None:
    x = ex("x", arguments={"alternate-exchange": "ae"})
    with pytest.raises(AttributeError):
        x.name = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        x.arguments["k"] = 1  # type: ignore[index]
    assert x.alternate_exchange == "ae"
    assert {x, ex("x", arguments={"alternate-exchange": "ae"})} == {x}
    b = q("x", "q", "k", a=1)
    assert hash(b) == hash(q("x", "q", "k", a=1))
    assert b == q("x", "q", "k", a=1)


def test_binding_destination_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="queue or exchange"):
        Binding("x", "q", "topic")


def test_predeclared_exchanges() -> None:
    names = {x.name: x.type for x in predeclared("/v")}
    assert names == {
        "": DIRECT,
        "amq.direct": DIRECT,
        "amq.fanout": FANOUT,
        "amq.topic": TOPIC,
        "amq.headers": HEADERS,
        "amq.match": HEADERS,
    }
    assert all(x.vhost == "/v" and x.durable and not x.internal for x in predeclared("/v"))


# -- the default exchange --------------------------------------------------------------


def test_default_exchange_routes_to_the_queue_named_by_the_key() -> None:
    assert route([], [], "", "orders") == {"orders"}
    assert route([], [], "", "") == set()


def test_default_exchange_only_to_existing_queues_when_known() -> None:
    table = RoutingTable([], [], queues={"a"})
    assert table.route("", "a") == {"a"}
    assert table.route("", "b") == set()


def test_default_exchange_ignores_bindings_from_it() -> None:
    assert route([], [q("", "other", "k")], "", "k") == {"k"}


def test_default_exchange_cannot_be_declared_deleted_or_bound() -> None:
    for error in (
        lambda: check_exchange_declare(ex(""), None),
        lambda: check_exchange_declare(ex(""), ex(""), passive=True),
        lambda: check_exchange_delete(V, ""),
        lambda: check_binding(q("", "q", "k")),
        lambda: check_binding(x2x("amq.direct", "")),
    ):
        with pytest.raises(ChannelError) as caught:
            error()
        assert caught.value.code == ACCESS_REFUSED
        assert caught.value.text == "operation not permitted on the default exchange"
        assert caught.value.reply_text.startswith("ACCESS_REFUSED - ")


# -- direct and fanout -----------------------------------------------------------------


def test_direct_matches_the_whole_key() -> None:
    bindings = [q("amq.direct", "a", "k"), q("amq.direct", "b", "k"), q("amq.direct", "c", "k.x")]
    assert route([], bindings, "amq.direct", "k") == {"a", "b"}
    assert route([], bindings, "amq.direct", "k.x") == {"c"}
    assert route([], bindings, "amq.direct", "K") == set()
    assert route([], [q("amq.direct", "e", "")], "amq.direct", "") == {"e"}


def test_fanout_ignores_the_key() -> None:
    bindings = [q("amq.fanout", "a", "x"), q("amq.fanout", "b")]
    assert route([], bindings, "amq.fanout", "anything") == {"a", "b"}


def test_a_queue_bound_twice_gets_the_message_once() -> None:
    bindings = [q("amq.fanout", "a", "1"), q("amq.fanout", "a", "2")]
    assert route([], bindings, "amq.fanout", "") == {"a"}


# -- topic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("*", "a", True),
        ("*", "", False),  # "" has no words
        ("*", "a.b", False),
        ("*.*", ".", True),  # "." is two empty words
        ("a.*", "a.", True),
        ("a.*", "a", False),
        ("#", "", True),
        ("#", "a.b.c", True),
        ("#.#", "", True),
        ("#.#", "a", True),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("a.#", "b.a", False),
        ("#.a", "a", True),
        ("#.a", "x.y.a", True),
        ("a.#.b", "a.b", True),
        ("a.#.b", "a.x.y.b", True),
        ("a.#.b", "a.x.y", False),
        ("a.#.b", "a.b.b", True),
        ("a.*.#", "a", False),
        ("a.*.#", "a.b", True),
        ("#.*", "", False),
        ("#.*", "a.b", True),
        ("*.#.*", "a", False),
        ("*.#.*", "a.b", True),
        ("", "", True),
        ("", "a", False),
        ("a..b", "a..b", True),
        ("a.*.b", "a..b", True),
        ("a*", "ab", False),  # '*' inside a word is a literal character
        ("a*", "a*", True),
        ("a.#", "a.#", True),
    ],
)
def test_topic_matching(pattern: str, key: str, expected: bool) -> None:
    assert topic_matches(pattern, key) is expected


def test_topic_words() -> None:
    assert topic_words("") == ()
    assert topic_words("a") == ("a",)
    assert topic_words("a.") == ("a", "")
    assert topic_words(".") == ("", "")


def test_topic_matcher_collects_every_matching_binding() -> None:
    matcher = TopicMatcher()
    for pattern in ("#", "a.*", "a.#", "*.b", "a.b", "x"):
        matcher.add(pattern, (QUEUE, pattern))
    assert {name for _, name in matcher.match("a.b")} == {"#", "a.*", "a.#", "*.b", "a.b"}


def test_topic_many_hashes_stay_fast() -> None:
    matcher = TopicMatcher()
    matcher.add(".".join(["#"] * 30) + ".z", (QUEUE, "q"))
    assert matcher.match(".".join(["a"] * 200)) == []
    assert matcher.match(".".join(["a"] * 200) + ".z") == [(QUEUE, "q")]


def test_topic_routes_through_an_exchange() -> None:
    bindings = [q("amq.topic", "eu", "orders.eu.*"), q("amq.topic", "all", "orders.#")]
    assert route([], bindings, "amq.topic", "orders.eu.paris") == {"eu", "all"}
    assert route([], bindings, "amq.topic", "orders") == {"all"}
    assert route([], bindings, "amq.topic", "invoices.eu.x") == set()


def _reference(pattern: str, key: str) -> bool:
    # Each word ends with '.', so "" (no words) is the empty string.
    parts = []
    for word in topic_words(pattern):
        if word == "#":
            parts.append(r"(?:[^.]*\.)*")
        elif word == "*":
            parts.append(r"[^.]*\.")
        else:
            parts.append(re.escape(word) + r"\.")
    subject = "".join(word + "." for word in topic_words(key))
    return re.fullmatch("".join(parts), subject) is not None


_words = st.sampled_from(["a", "b", "", "ab", "*x", "#"])
_pattern_words = st.sampled_from(["a", "b", "", "ab", "*", "#", "*x"])


@settings(max_examples=500)
@given(
    st.lists(_pattern_words, max_size=6).map(".".join),
    st.lists(_words, max_size=8).map(".".join),
)
def test_topic_agrees_with_a_reference_regex(pattern: str, key: str) -> None:
    assert topic_matches(pattern, key) is _reference(pattern, key)


@settings(max_examples=200)
@given(
    st.lists(st.lists(_pattern_words, max_size=5).map(".".join), max_size=8),
    st.lists(_words, max_size=6).map(".".join),
)
def test_topic_matcher_agrees_with_each_pattern_alone(patterns: list[str], key: str) -> None:
    matcher = TopicMatcher()
    for n, pattern in enumerate(patterns):
        matcher.add(pattern, (QUEUE, str(n)))
    found = {int(name) for _, name in matcher.match(key)}
    assert found == {n for n, pattern in enumerate(patterns) if _reference(pattern, key)}


# -- headers ---------------------------------------------------------------------------


def _headers(*bindings: Binding) -> RoutingTable:
    return RoutingTable([], list(bindings))


def test_headers_all_is_the_default() -> None:
    table = _headers(q("amq.headers", "q", "", format="pdf", type="report"))
    assert table.route("amq.headers", "", {"format": "pdf", "type": "report", "x": 1}) == {"q"}
    assert table.route("amq.headers", "", {"format": "pdf"}) == set()


def test_headers_any() -> None:
    table = _headers(q("amq.match", "q", "", **{"x-match": "any", "a": 1, "b": 2}))
    assert table.route("amq.match", "", {"b": 2}) == {"q"}
    assert table.route("amq.match", "", {"a": 2, "b": 1}) == set()
    assert table.route("amq.match", "", None) == set()


def test_headers_all_with_no_arguments_matches_everything_and_any_nothing() -> None:
    assert _headers(q("amq.headers", "q")).route("amq.headers", "", None) == {"q"}
    any_binding = q("amq.headers", "q", "", **{"x-match": "any"})
    assert _headers(any_binding).route("amq.headers", "", {"a": 1}) == set()


def test_headers_x_arguments_ignored_by_all_and_any() -> None:
    table = _headers(q("amq.headers", "q", "", **{"x-match": "all", "x-tag": "t", "a": 1}))
    assert table.route("amq.headers", "", {"a": 1}) == {"q"}
    table = _headers(q("amq.headers", "q", "", **{"x-match": "any", "x-tag": "t"}))
    assert table.route("amq.headers", "", {"x-tag": "t"}) == set()


def test_headers_with_x_modes_compare_x_arguments() -> None:
    all_x = q("amq.headers", "q", "", **{"x-match": "all-with-x", "x-tag": "t", "a": 1})
    assert _headers(all_x).route("amq.headers", "", {"a": 1}) == set()
    assert _headers(all_x).route("amq.headers", "", {"a": 1, "x-tag": "t"}) == {"q"}
    any_x = q("amq.headers", "q", "", **{"x-match": "any-with-x", "x-tag": "t", "a": 1})
    assert _headers(any_x).route("amq.headers", "", {"x-tag": "t"}) == {"q"}
    assert _headers(any_x).route("amq.headers", "", {"x-match": "any-with-x"}) == set()


def test_headers_void_argument_matches_presence() -> None:
    table = _headers(q("amq.headers", "q", "", flag=None))
    assert table.route("amq.headers", "", {"flag": "anything"}) == {"q"}
    assert table.route("amq.headers", "", {"flag": None}) == {"q"}
    assert table.route("amq.headers", "", {"other": 1}) == set()


def test_headers_values_compare_type_and_value() -> None:
    table = _headers(q("amq.headers", "q", "", n=1))
    assert table.route("amq.headers", "", {"n": 1}) == {"q"}
    assert table.route("amq.headers", "", {"n": True}) == set()
    assert table.route("amq.headers", "", {"n": 1.0}) == set()
    assert table.route("amq.headers", "", {"n": "1"}) == set()
    table = _headers(q("amq.headers", "q", "", s="é"))
    assert table.route("amq.headers", "", {"s": "é"}) == {"q"}
    table = _headers(q("amq.headers", "q", "", t={"k": [1, "v"]}))
    assert table.route("amq.headers", "", {"t": {"k": [1, "v"]}}) == {"q"}
    assert table.route("amq.headers", "", {"t": {"k": [True, "v"]}}) == set()


def test_headers_exchange_ignores_the_routing_key() -> None:
    table = _headers(q("amq.headers", "q", "some-key"))
    assert table.route("amq.headers", "other-key", {}) == {"q"}


def test_headers_binding_x_match_is_validated() -> None:
    headers = ex("h", HEADERS)
    for mode in ("all", "any", "all-with-x", "any-with-x"):
        check_binding(q("h", "q", "", **{"x-match": mode}), headers)
    check_binding(q("h", "q", ""), headers)
    check_binding(q("d", "q", "", **{"x-match": "bogus"}), ex("d"))  # not a headers exchange
    with pytest.raises(ChannelError) as caught:
        check_binding(q("h", "q", "", **{"x-match": "some"}), headers)
    assert caught.value.code == PRECONDITION_FAILED
    assert caught.value.text == (
        'Invalid x-match field value <<"some">>; expected all, any, all-with-x, or any-with-x'
    )
    with pytest.raises(ChannelError) as caught:
        check_binding(q("h", "q", "", **{"x-match": 1}), headers)
    assert caught.value.text.startswith("Invalid x-match field type signedint")
    assert caught.value.text.endswith("expected longstr")


# -- exchange to exchange --------------------------------------------------------------


def test_exchange_to_exchange_is_followed_transitively() -> None:
    exchanges = [ex("a", FANOUT), ex("b", TOPIC), ex("c", DIRECT)]
    bindings = [x2x("a", "b"), x2x("b", "c", "k.*"), q("c", "end", "k.1"), q("b", "mid", "#")]
    assert route(exchanges, bindings, "a", "k.1") == {"end", "mid"}
    assert route(exchanges, bindings, "a", "k.2") == {"mid"}


def test_exchange_cycles_end_and_each_exchange_is_visited_once() -> None:
    exchanges = [ex("a", FANOUT), ex("b", FANOUT)]
    bindings = [x2x("a", "b"), x2x("b", "a"), x2x("a", "a"), q("a", "qa"), q("b", "qb")]
    assert route(exchanges, bindings, "a", "") == {"qa", "qb"}
    assert route(exchanges, bindings, "b", "") == {"qa", "qb"}


def test_a_queue_reached_by_two_paths_gets_the_message_once() -> None:
    exchanges = [ex("a", FANOUT), ex("b", FANOUT), ex("c", FANOUT)]
    bindings = [x2x("a", "b"), x2x("a", "c"), q("b", "q"), q("c", "q")]
    assert route(exchanges, bindings, "a", "") == {"q"}


def test_missing_destination_exchange_is_skipped() -> None:
    bindings = [x2x("amq.fanout", "gone"), q("amq.fanout", "q")]
    assert route([], bindings, "amq.fanout", "") == {"q"}


def test_internal_exchange_reached_through_a_binding_but_not_published_to() -> None:
    exchanges = [ex("inner", FANOUT, internal=True)]
    bindings = [x2x("amq.fanout", "inner"), q("inner", "q")]
    assert route(exchanges, bindings, "amq.fanout", "") == {"q"}
    with pytest.raises(ChannelError) as caught:
        route(exchanges, bindings, "inner", "")
    assert caught.value.code == ACCESS_REFUSED
    assert caught.value.text == "cannot publish to internal exchange 'inner' in vhost '/'"


def test_missing_exchange_is_404() -> None:
    with pytest.raises(ChannelError) as caught:
        route([], [], "nope", "")
    assert caught.value.code == NOT_FOUND
    assert caught.value.reply_text == "NOT_FOUND - no exchange 'nope' in vhost '/'"


def test_alternate_exchange_takes_what_routes_nowhere() -> None:
    exchanges = [ex("main", DIRECT, arguments={"alternate-exchange": "ae"}), ex("ae", FANOUT)]
    bindings = [q("main", "known", "k"), q("ae", "unrouted")]
    assert route(exchanges, bindings, "main", "k") == {"known"}
    assert route(exchanges, bindings, "main", "other") == {"unrouted"}


def test_alternate_exchange_cycle_ends() -> None:
    exchanges = [
        ex("a", DIRECT, arguments={"alternate-exchange": "b"}),
        ex("b", DIRECT, arguments={"alternate-exchange": "a"}),
    ]
    assert route(exchanges, [], "a", "k") == set()


# -- sender-selected distribution ------------------------------------------------------


def test_cc_and_bcc_are_more_routing_keys() -> None:
    assert routing_keys("k", None) == ("k",)
    assert routing_keys("k", {"CC": ["a", b"b", 3], "BCC": ("c", "k")}) == ("k", "a", "b", "c")
    assert routing_keys("k", {"CC": "not-an-array"}) == ("k",)
    bindings = [q("amq.direct", "qa", "a"), q("amq.direct", "qc", "c"), q("amq.topic", "t", "c.*")]
    headers = {"CC": ["a"], "BCC": ["c"]}
    assert route([], bindings, "amq.direct", "none", headers) == {"qa", "qc"}
    assert route([], bindings, "", "k", headers) == {"k", "a", "c"}
    assert route([], bindings, "amq.topic", "k", {"CC": ["c.x"]}) == {"t"}


# -- the table -------------------------------------------------------------------------


def test_table_keeps_one_vhost() -> None:
    with pytest.raises(ValueError, match="several vhosts"):
        RoutingTable([Exchange("/", "a"), Exchange("/b", "b")], [])
    table = RoutingTable([], [], vhost="/b")
    assert table.vhost == "/b"
    assert table.exchange("amq.topic") == Exchange("/b", "amq.topic", TOPIC)
    assert table.exchange("nope") is None


def test_table_filters_queues_it_is_told_exist() -> None:
    table = RoutingTable([], [q("amq.fanout", "a"), q("amq.fanout", "gone")], queues={"a"})
    assert table.route("amq.fanout", "") == {"a"}


def test_given_exchange_replaces_a_predeclared_one() -> None:
    table = RoutingTable([Exchange(V, "amq.direct", DIRECT, durable=False)], [])
    assert table.exchange("amq.direct") == Exchange(V, "amq.direct", DIRECT, durable=False)


# -- declare, redeclare, delete --------------------------------------------------------


def test_exchange_types() -> None:
    for kind in (DIRECT, FANOUT, TOPIC, HEADERS):
        assert check_exchange_type(kind) == kind
    with pytest.raises(ChannelError) as caught:
        check_exchange_type("x-delayed-message")
    assert caught.value.code == PRECONDITION_FAILED
    assert caught.value.text == "unknown exchange type 'x-delayed-message'"


def test_redeclare_texts() -> None:
    base = ex("x", DIRECT)
    assert check_redeclare(base, ex("x", DIRECT)) is None
    cases = {
        ex("x", FANOUT): "inequivalent arg 'type' for exchange 'x' in vhost '/': "
        "received 'fanout' but current is 'direct'",
        ex("x", durable=False): "inequivalent arg 'durable' for exchange 'x' in vhost '/': "
        "received 'false' but current is 'true'",
        ex("x", auto_delete=True): "inequivalent arg 'auto_delete' for exchange 'x' in vhost "
        "'/': received 'true' but current is 'false'",
        ex("x", internal=True): "inequivalent arg 'internal' for exchange 'x' in vhost '/': "
        "received 'true' but current is 'false'",
        ex("x", arguments={"alternate-exchange": "ae"}): "inequivalent arg "
        "'alternate-exchange' for exchange 'x' in vhost '/': received the value 'ae' of type "
        "'longstr' but current is none",
    }
    for requested, text in cases.items():
        error = check_redeclare(base, requested)
        assert error is not None
        assert error.code == PRECONDITION_FAILED
        assert error.text == text


def test_redeclare_ignores_arguments_without_meaning() -> None:
    assert check_redeclare(ex("x", arguments={"other": 1}), ex("x")) is None
    with_ae = ex("x", arguments={"alternate-exchange": "ae"})
    assert check_redeclare(with_ae, ex("x", arguments={"alternate-exchange": "ae"})) is None
    changed = check_redeclare(with_ae, ex("x", arguments={"alternate-exchange": "other"}))
    assert changed is not None
    assert "received the value 'other'" in changed.text


def test_declare_checks() -> None:
    check_exchange_declare(ex("new", TOPIC), None)
    check_exchange_declare(ex("amq.direct"), ex("amq.direct"))  # existing: prefix allowed
    check_exchange_declare(ex("x", "bogus"), ex("x"), passive=True)  # passive: type unchecked
    with pytest.raises(ChannelError) as caught:
        check_exchange_declare(ex("amq.mine"), None)
    assert caught.value.code == ACCESS_REFUSED
    assert caught.value.text == "exchange name 'amq.mine' contains reserved prefix 'amq.*'"
    with pytest.raises(ChannelError) as caught:
        check_exchange_declare(ex("x"), None, passive=True)
    assert caught.value.code == NOT_FOUND
    assert caught.value.text == "no exchange 'x' in vhost '/'"
    with pytest.raises(ChannelError) as caught:
        check_exchange_declare(ex("x", "bogus"), None)
    assert caught.value.text == "unknown exchange type 'bogus'"
    with pytest.raises(ChannelError) as caught:
        check_exchange_declare(ex("amq.direct", FANOUT), ex("amq.direct"))
    assert caught.value.code == PRECONDITION_FAILED
    with pytest.raises(ChannelError) as caught:
        check_exchange_declare(ex("x", arguments={"alternate-exchange": 5}), None)
    assert caught.value.text == (
        "invalid type 'signedint' for arg 'alternate-exchange' in exchange 'x' in vhost '/'"
    )


def test_delete_checks() -> None:
    check_exchange_delete(V, "mine")
    with pytest.raises(ChannelError) as caught:
        check_exchange_delete(V, "amq.topic")
    assert caught.value.code == ACCESS_REFUSED
    assert caught.value.text == "deletion of system exchange 'amq.topic' in vhost '/' not allowed"


# -- properties ------------------------------------------------------------------------

_header_values = st.sampled_from([None, 1, True, 1.0, "1", "a"])
_header_names = st.sampled_from(["a", "b", "x-a", "x-match"])


def _reference_headers(mode: str, arguments: dict[str, object], headers: dict[str, object]) -> bool:
    with_x = mode.endswith("-with-x")
    tests = [
        (key, value)
        for key, value in arguments.items()
        if key != "x-match" and (with_x or not key.startswith("x-"))
    ]

    def hit(key: str, value: object) -> bool:
        if key not in headers:
            return False
        if value is None:
            return True
        other = headers[key]
        return type(other) is type(value) and other == value

    if mode.startswith("any"):
        return any(hit(key, value) for key, value in tests)
    return all(hit(key, value) for key, value in tests)


@settings(max_examples=300)
@given(
    st.sampled_from(["all", "any", "all-with-x", "any-with-x"]),
    st.dictionaries(_header_names, _header_values, max_size=4),
    st.dictionaries(_header_names, _header_values, max_size=4),
)
def test_headers_agree_with_a_reference(
    mode: str, arguments: dict[str, object], headers: dict[str, object]
) -> None:
    arguments = {**arguments, "x-match": mode}
    table = _headers(Binding("amq.headers", "q", QUEUE, "", arguments))
    expected = {"q"} if _reference_headers(mode, arguments, headers) else set()
    assert table.route("amq.headers", "", headers) == expected


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=12),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=8),
    st.integers(0, 5),
)
def test_exchange_graphs_route_to_every_reachable_queue(
    edges: list[tuple[int, int]], queues: list[tuple[int, int]], start: int
) -> None:
    exchanges = [ex(f"e{n}", FANOUT) for n in range(6)]
    bindings = [x2x(f"e{a}", f"e{b}") for a, b in edges]
    bindings += [q(f"e{a}", f"q{b}") for a, b in queues]
    reachable, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for a, b in edges:
            if a == node and b not in reachable:
                reachable.add(b)
                todo.append(b)
    expected = {f"q{b}" for a, b in queues if a in reachable}
    assert route(exchanges, bindings, f"e{start}", "") == expected


def reference_match(pattern: str, key: str) -> bool:
    """The topic rule by backtracking (exponential, fine on short keys): '*' one word,
    '#' zero or more."""
    pat, words = topic_words(pattern), topic_words(key)

    def go(i: int, j: int) -> bool:
        if i == len(pat):
            return j == len(words)
        if pat[i] == "#":
            return any(go(i + 1, k) for k in range(j, len(words) + 1))
        return j < len(words) and pat[i] in ("*", words[j]) and go(i + 1, j + 1)

    return go(0, 0)


_WORD = st.sampled_from(["a", "b", "", "*", "#"])


@given(
    st.lists(st.lists(_WORD, max_size=6).map(".".join), min_size=1, max_size=4),
    st.lists(st.sampled_from(["a", "b", ""]), max_size=7).map(".".join),
)
def test_the_linear_matcher_agrees_with_the_rule(patterns: list[str], key: str) -> None:
    matcher = TopicMatcher()
    for n, pattern in enumerate(patterns):
        matcher.add(pattern, (QUEUE, str(n)))
    got = {name for _, name in matcher.match(key)}
    assert got == {str(n) for n, p in enumerate(patterns) if reference_match(p, key)}


def test_the_worst_topic_publish_is_short_and_long_keys_are_refused() -> None:
    """Issue 34, finding 2: a binding of 128 '#' and 128-word keys took 160-210 ms a
    publish on the dispatcher's loop. Runs of '#' collapse, '#' takes one word a step,
    and a new binding key has at most MAX_TOPIC_WORDS words."""
    assert topic_pattern("#.#.#.a.#.#") == ("#", "a", "#")
    matcher = TopicMatcher()
    matcher.add(".".join(["#"] * 128), (QUEUE, "q"))
    assert matcher.match(".".join(["w"] * 127)) == [(QUEUE, "q")]
    topic = Exchange("/", "t", TOPIC, True, False, False, {})
    check_new_binding(Binding("t", "q", QUEUE, ".".join(["#"] * 128), {}), topic)  # one '#'
    with pytest.raises(ChannelError, match="topic binding key of 33 words: at most 32"):
        check_new_binding(Binding("t", "q", QUEUE, ".".join(["#", "*"] * 16 + ["x"]), {}), topic)


def test_a_topic_exchange_holds_a_bounded_number_of_key_words() -> None:
    """The matcher's work per publish grows with the words of an exchange's distinct
    keys, so a new binding past MAX_TOPIC_EXCHANGE_WORDS is refused (406); the same key
    bound again costs nothing."""
    topic = Exchange("/", "t", TOPIC, True, False, False, {})
    key = ".".join(["*", "#"] * 15 + ["*"])  # 31 words: with ".n", 32 and one start bit
    full = [
        Binding("t", f"q{n}", QUEUE, f"{key}.{n}", {})
        for n in range(MAX_TOPIC_EXCHANGE_WORDS // (MAX_TOPIC_WORDS + 1))
    ]
    check_new_binding(Binding("t", "q", QUEUE, full[0].routing_key, {}), topic, full)
    check_new_binding(Binding("t", "q", QUEUE, "other", {}), topic, full[1:])
    with pytest.raises(ChannelError, match=r"would hold \d+ words .*at most 65536"):
        check_new_binding(Binding("t", "q", QUEUE, f"{key}.more", {}), topic, full)
