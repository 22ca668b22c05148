"""batch.build's fast paths (`_plain`) give the general loop's call and its errors.

The fast paths make their call without rows and hand back to the general
loop as soon as a message needs more; both must refuse a batch with the same
error at the same message, and a fast call must carry what the general call
would for the same messages.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pepsi.config import Config, load_config
from pepsi.errors import PepsiError
from pepsi.publishing import OutgoingMessage, batch

CONF = """
[pepsi-ingress]
MAX_MESSAGE_SIZE = 1K
[stage-a]
HANDLER = tests.stages:noop
[stage-b]
HANDLER = tests.stages:noop
[stage-limited]
HANDLER = tests.stages:noop
MAX_LENGTH = 10
"""

body = st.one_of(
    st.none(),
    st.binary(max_size=40),
    st.text(max_size=40),
    st.just("\ud800"),  # not encodable
    st.integers(),
    st.builds(bytearray, st.binary(max_size=8)),
    st.just(b"x" * 600),  # two of them are over MAX_MESSAGE_SIZE
)
extra = st.sampled_from([{}, {}, {}, {"subject": "s"}, {"priority": 3}, {"message_id": "m"}])
message = st.builds(
    lambda stage, b, h, fields: OutgoingMessage(stage, b, h, **fields),
    st.sampled_from(["a", "a", "b", "limited", "nope", ""]),
    body,
    st.one_of(st.none(), body),
    extra,
)
good = st.builds(
    OutgoingMessage, st.sampled_from(["a", "b"]), st.binary(max_size=40), st.just(None)
)


@pytest.fixture(scope="module")
def conf(tmp_path_factory: pytest.TempPathFactory) -> Config:
    path = tmp_path_factory.mktemp("conf") / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


def outcome(messages: list[OutgoingMessage], conf: Config, *, fast: bool) -> Any:
    try:
        return batch.build(messages, conf, fast=fast)
    except PepsiError as exc:
        return (type(exc), str(exc))


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.one_of(good, good, good, message), min_size=1, max_size=5))
def test_the_fast_paths_refuse_and_carry_what_the_general_call_does(
    conf: Config, messages: list[OutgoingMessage]
) -> None:
    fast, general = outcome(messages, conf, fast=True), outcome(messages, conf, fast=False)
    if isinstance(general, tuple):
        assert fast == general
        return
    assert isinstance(fast, batch.BatchCall)
    assert fast.positions == general.positions
    if fast.sql is batch.SQL:
        assert fast == general
        return
    stages, headers, bodies = general.params[0], general.params[13], general.params[14]
    if fast.sql is batch.ONE_SQL:
        assert fast.params == (stages[0], headers[0], bodies[0])
    else:
        assert fast.sql is batch.PLAIN_SQL
        assert fast.params == (stages, headers, bodies)
    assert all(m.stage in ("a", "b") for m in messages)
