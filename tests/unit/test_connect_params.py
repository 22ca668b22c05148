"""The parameters every Pepsi connection gets (no database needed)."""

from __future__ import annotations

from pepsi.db.connect import KEEPALIVES, connect_params

MULTI_HOST = "host=db1,db2,db3 dbname=pepsi target_session_attrs=read-write"


def test_keepalives_notice_a_vanished_primary_before_a_failover_completes() -> None:
    params = connect_params(MULTI_HOST, application_name="p", timeout=10)
    assert {k: params[k] for k in KEEPALIVES} == KEEPALIVES
    silence = params["keepalives_idle"] + params["keepalives_interval"] * params["keepalives_count"]
    assert silence < 20  # Patroni's smallest ttl


def test_a_dsn_with_its_own_keepalives_keeps_them() -> None:
    params = connect_params(MULTI_HOST + " keepalives_idle=60", application_name="p", timeout=10)
    assert not any(name in params for name in KEEPALIVES)


def test_timeout_is_whole_seconds_never_zero() -> None:
    assert connect_params(MULTI_HOST, application_name="p", timeout=0.2)["connect_timeout"] == 1
    assert connect_params(MULTI_HOST, application_name="p", timeout=2.6)["connect_timeout"] == 3


def test_settings_join_the_dsn_options() -> None:
    params = connect_params(
        "dbname=x options='-c work_mem=8MB'",
        application_name="p",
        timeout=10,
        settings={"synchronous_commit": "off"},
    )
    assert params["options"] == "-c work_mem=8MB -c synchronous_commit=off"
