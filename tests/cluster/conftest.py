"""A real three-node cluster (Patroni, etcd, PostgreSQL) for the replication tests.

Marked `cluster`: `python3 scripts/dev.py test` runs them after the rest of
the suite, alone (each failover takes Patroni's TTL, 20 s); `-m "not
cluster"` leaves them out locally.
"""

from __future__ import annotations

import random
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pepsi.cluster.harness import Cluster
from pepsi.cluster.layout import NODES, Layout
from pepsi.db import schema


def _free_base_port() -> int:
    """A base port whose etcd, PostgreSQL and REST ports are all free now."""
    for _ in range(100):
        base = random.randrange(20000, 60000, 100)
        layout = Layout(Path("/"), base)
        ports = [layout.etcd_client_port, layout.etcd_peer_port]
        ports += [layout.pg_port(n) for n in NODES] + [layout.api_port(n) for n in NODES]
        try:
            for port in ports:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports for a cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: python3 scripts/dev.py setup installs it (as root)")
    root = tmp_path_factory.mktemp("cluster")
    made = Cluster(Layout(root, _free_base_port()))
    made.create()
    try:
        made.start()
        yield made
    finally:
        made.destroy()


@pytest.fixture
def healthy(cluster: Cluster) -> Cluster:
    """Every node running and streaming before the test (a previous one killed some)."""
    cluster.start()
    return cluster


def fresh_database(cluster: Cluster, name: str) -> str:
    """A new database with Pepsi's schema on the cluster; its multi-host DSN."""
    with psycopg.connect(cluster.layout.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = cluster.layout.dsn(name)
    with psycopg.connect(dsn) as conn:
        schema.install(conn)
    return dsn
