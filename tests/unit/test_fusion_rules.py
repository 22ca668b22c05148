"""The fusion rules (W-10), pure."""

from __future__ import annotations

import pytest

from pepsi.config import StageConfig
from pepsi.stage import Needs
from pepsi.worker.fusion import FUSION_DEPTH, fusable, may_fuse

PYTHON = StageConfig("p", handler="m:f")
BUILTIN = StageConfig("b", handler="pepsi.stages.set_:run", builtin="set")
EXTERNAL = StageConfig("x", program="/usr/bin/x", fusion=True)


def test_who_may_be_fused_by_configuration() -> None:
    assert fusable(BUILTIN)  # built-ins: yes by default
    assert not fusable(PYTHON)  # a Python stage says FUSION = yes
    assert fusable(StageConfig("p", handler="m:f", fusion=True))
    assert not fusable(
        StageConfig("b", handler="pepsi.stages.set_:run", builtin="set", fusion=False)
    )
    assert not fusable(EXTERNAL)  # another process: never


def ok(**changes: object) -> bool:
    args: dict[str, object] = {
        "loaded": Needs.METADATA,
        "needs": Needs.METADATA,
        "depth": 1,
        "refused": False,
        "changed": False,
        "overridden": False,
    }
    args.update(changes)
    return may_fuse(BUILTIN, **args)  # type: ignore[arg-type]


def test_every_rule_can_forbid_it() -> None:
    assert ok()
    assert not ok(refused=True)
    assert not ok(changed=True)
    assert not ok(overridden=True)
    assert not ok(depth=FUSION_DEPTH)
    assert ok(depth=FUSION_DEPTH - 1)


@pytest.mark.parametrize(
    ("loaded", "needs", "expected"),
    [
        (Needs.METADATA, Needs.METADATA, True),
        (Needs.METADATA, Needs.HEADER, False),
        (Needs.METADATA, Needs.BODY, False),
        (Needs.BODY, Needs.HEADER, True),
        (Needs.HEADER, Needs.BODY, False),
    ],
)
def test_a_successor_may_need_no_more_than_is_loaded(
    loaded: Needs, needs: Needs, expected: bool
) -> None:
    assert ok(loaded=loaded, needs=needs) is expected
