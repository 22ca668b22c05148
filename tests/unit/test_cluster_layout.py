"""The development cluster's layout: ports, DSNs and the settings that carry Q-2."""

from __future__ import annotations

from pathlib import Path

from psycopg import conninfo

from pepsi.cluster import layout
from pepsi.cluster.layout import NODES, Layout, Secrets

SECRETS = Secrets("super-secret", "repl-secret")


def test_every_port_is_distinct_and_follows_the_base() -> None:
    plan = Layout(Path("/c"), 40000)
    ports = [plan.etcd_client_port, plan.etcd_peer_port]
    ports += [plan.pg_port(n) for n in NODES] + [plan.api_port(n) for n in NODES]
    assert len(set(ports)) == len(ports)
    assert min(ports) == 40000
    assert max(ports) == 40023


def test_the_dsn_names_every_node_and_asks_for_the_writable_one() -> None:
    plan = Layout(Path("/c"), 40000)
    params = conninfo.conninfo_to_dict(plan.dsn())
    assert params["host"] == "127.0.0.1,127.0.0.1,127.0.0.1"
    assert params["port"] == "40011,40012,40013"
    assert params["target_session_attrs"] == "read-write"
    assert params["passfile"] == "/c/pepsi.pgpass"
    assert "password" not in params  # the secret stays in the passfile


def test_patroni_runs_quorum_commit_in_strict_mode() -> None:
    config = Layout(Path("/c")).patroni_config("n2", SECRETS, Path("/bin"))
    dcs = config["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] == "quorum"
    assert dcs["synchronous_mode_strict"] is True  # never confirm on one node
    assert dcs["synchronous_node_count"] == 1  # primary + 1 of 2 standbys = majority
    assert dcs["postgresql"]["use_pg_rewind"] is True
    # an old primary whose rewind fails is cloned again rather than left stopped
    assert dcs["postgresql"]["remove_data_directory_on_rewind_failure"] is True
    assert dcs["postgresql"]["remove_data_directory_on_diverged_timelines"] is True
    assert config["name"] == "n2"
    assert config["postgresql"]["listen"] == "127.0.0.1:54412"


def test_failover_timings_satisfy_patroni() -> None:
    assert layout.LOOP_WAIT + 2 * layout.RETRY_TIMEOUT <= layout.TTL
    assert layout.TTL >= 20  # Patroni raises a smaller ttl to 20 anyway


def test_no_rule_lets_a_client_in_without_a_password() -> None:
    config = Layout(Path("/c")).patroni_config("n1", SECRETS, Path("/bin"))
    rules = config["postgresql"]["pg_hba"]
    assert all(rule.split()[-1] == "scram-sha-256" for rule in rules)
    assert config["postgresql"]["parameters"]["unix_socket_directories"] == ""
