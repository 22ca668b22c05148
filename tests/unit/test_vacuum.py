from __future__ import annotations

from pepsi.dispatch.services.vacuum import Vacuum


def test_a_run_is_due_every_after_passes() -> None:
    vacuum = Vacuum("dsn", after=100, connect_timeout=10.0)
    assert not vacuum.due(99)
    assert vacuum.due(100)
    vacuum.started_at = 100
    assert not vacuum.due(150)
    assert vacuum.due(200)


def test_zero_means_never() -> None:
    assert not Vacuum("dsn", after=0, connect_timeout=10.0).due(10**9)
