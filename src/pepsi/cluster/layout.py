"""Where a development cluster lives and how its parts are configured (pure).

Three PostgreSQL nodes under Patroni, one etcd member as Patroni's store,
all on loopback. Ports follow from one base port, files from one directory;
nothing here touches either. The Patroni settings are the guarantee:

- `synchronous_mode: quorum` with `synchronous_node_count: 1` makes the
  primary commit with `synchronous_standby_names = 'ANY 1 (…)'` over the two
  standbys: a commit returns once a majority (primary + one) has it.
- `synchronous_mode_strict: true` keeps that rule with no standby left:
  writes wait rather than be confirmed on one node, and no failover window
  runs without it (pg_auto_failover's `wait_primary` does).
- Patroni promotes only a standby that was in the quorum, so a confirmed
  write survives the loss of any one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

NODES = ("n1", "n2", "n3")
SCOPE = "pepsi"
DATABASE = "pepsi"
SUPERUSER = "postgres"
REPLICATION_USER = "replicator"
DEFAULT_BASE_PORT = 54400

# Failover timings. Patroni requires loop_wait + 2 * retry_timeout <= ttl.
# These detect a lost primary within ~ttl seconds: tighter than Patroni's
# defaults (30/10/10), which suit hosts on a real network, not loopback.
TTL = 20  # Patroni's minimum
LOOP_WAIT = 1
RETRY_TIMEOUT = 4


@dataclass(frozen=True)
class Secrets:
    superuser: str
    replication: str


@dataclass(frozen=True)
class Layout:
    root: Path
    base_port: int = DEFAULT_BASE_PORT

    @property
    def etcd_client_port(self) -> int:
        return self.base_port

    @property
    def etcd_peer_port(self) -> int:
        return self.base_port + 1

    def pg_port(self, node: str) -> int:
        return self.base_port + 10 + NODES.index(node) + 1

    def api_port(self, node: str) -> int:
        return self.base_port + 20 + NODES.index(node) + 1

    def node_dir(self, node: str) -> Path:
        return self.root / node

    def data_dir(self, node: str) -> Path:
        return self.node_dir(node) / "data"

    def config_file(self, node: str) -> Path:
        return self.node_dir(node) / "patroni.yml"

    def pid_file(self, node: str) -> Path:
        return self.node_dir(node) / "patroni.pid"

    def log_file(self, node: str) -> Path:
        return self.node_dir(node) / "patroni.log"

    @property
    def etcd_dir(self) -> Path:
        return self.root / "etcd"

    @property
    def etcd_pid_file(self) -> Path:
        return self.root / "etcd.pid"

    @property
    def etcd_log_file(self) -> Path:
        return self.root / "etcd.log"

    @property
    def secrets_file(self) -> Path:
        return self.root / "secrets.json"

    @property
    def passfile(self) -> Path:
        """The client's pgpass (libpq's format): the DSN names it, never the password."""
        return self.root / "pepsi.pgpass"

    @property
    def layout_file(self) -> Path:
        return self.root / "cluster.json"

    def dsn(self, database: str = DATABASE) -> str:
        """A multi-host DSN: libpq tries each node and keeps the one that takes writes."""
        ports = ",".join(str(self.pg_port(n)) for n in NODES)
        hosts = ",".join("127.0.0.1" for _ in NODES)
        return (
            f"host={hosts} port={ports} dbname={database} user={SUPERUSER} "
            f"passfile={self.passfile} target_session_attrs=read-write"
        )

    def node_dsn(self, node: str, database: str = DATABASE) -> str:
        """One node, whatever its role (for status and tests)."""
        return (
            f"host=127.0.0.1 port={self.pg_port(node)} dbname={database} "
            f"user={SUPERUSER} passfile={self.passfile}"
        )

    def api_url(self, node: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.api_port(node)}/{path.lstrip('/')}"

    def etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self.etcd_client_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        return [
            "--name=pepsi-etcd",
            f"--data-dir={self.etcd_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pepsi-etcd={peer}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=pepsi-{self.base_port}",
        ]

    def patroni_config(self, node: str, secrets: Secrets, bin_dir: Path) -> dict[str, Any]:
        """The Patroni configuration of one node (written as JSON, which is YAML)."""
        listen = f"127.0.0.1:{self.pg_port(node)}"
        api = f"127.0.0.1:{self.api_port(node)}"
        return {
            "scope": SCOPE,
            "name": node,
            "log": {"dir": str(self.node_dir(node)), "level": "INFO"},
            "restapi": {"listen": api, "connect_address": api},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_client_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "synchronous_mode": "quorum",
                    "synchronous_mode_strict": True,
                    "synchronous_node_count": 1,
                    "postgresql": {
                        "use_pg_rewind": True,
                        # a rewind that fails leaves the old primary stopped: it is
                        # cloned from the new one instead (its own commits were never
                        # confirmed: the quorum commit is strict)
                        "remove_data_directory_on_rewind_failure": True,
                        "remove_data_directory_on_diverged_timelines": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "data-checksums"],
            },
            "postgresql": {
                "listen": listen,
                "connect_address": listen,
                "data_dir": str(self.data_dir(node)),
                "bin_dir": str(bin_dir),
                "pgpass": str(self.node_dir(node) / "patroni.pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": secrets.superuser},
                    "replication": {
                        "username": REPLICATION_USER,
                        "password": secrets.replication,
                    },
                },
                "parameters": {
                    # TCP on loopback only, password required: no socket to guard.
                    "unix_socket_directories": "",
                    "password_encryption": "scram-sha-256",
                    "logging_collector": "on",
                    "log_directory": str(self.node_dir(node) / "log"),
                    "idle_in_transaction_session_timeout": "5min",
                },
                "pg_hba": [
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                    "host all all 127.0.0.1/32 scram-sha-256",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
