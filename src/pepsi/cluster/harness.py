"""A three-node PostgreSQL cluster on this machine, for development and tests.

etcd and three Patroni nodes run as background processes, each in its own
session, their pids in the cluster directory; the PostgreSQL programs are
the embedded wheel's, so the cluster runs the same server version as the
default database. Started as root, everything runs as the embedded server's
system user (PostgreSQL refuses root).

`kill()` simulates the loss of a host: SIGKILL to Patroni and to every
process of its PostgreSQL, with no chance to hand over.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pepsi.cluster.layout import DATABASE, NODES, SUPERUSER, Layout, Secrets
from pepsi.cluster.processes import (
    POLL,
    STARTED,
    STOP_TIMEOUT,
    alive,
    kill_tree,
    postmaster_pid,
    read_pid,
    stop_orphan_postmaster,
    terminate,
)
from pepsi.db.queries import query
from pepsi.errors import PepsiError

START_TIMEOUT = 120.0  # seconds for a new cluster: initdb, two base backups


class ClusterError(PepsiError):
    """The development cluster cannot do what was asked (not created, not running …)."""


@dataclass(frozen=True)
class Member:
    """One node as Patroni reports it."""

    name: str
    role: str  # leader, quorum_standby, sync_standby, replica
    state: str  # running, streaming, starting, stopped …
    lag: int | None  # bytes behind the leader (replicas)
    timeline: int | None

    @property
    def is_leader(self) -> bool:
        return self.role == "leader"


def _which(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise ClusterError(
            f"{program} is not installed: run `python3 scripts/dev.py setup` "
            "(it installs Debian's etcd-server and the `cluster` extra: Patroni)"
        )
    return path


class Cluster:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    # -- lifecycle -----------------------------------------------------------------

    @classmethod
    def open(cls, root: Path) -> Cluster:
        """The cluster created in `root` (its ports are recorded there)."""
        root = root.expanduser().absolute()
        try:
            saved = json.loads((root / "cluster.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ClusterError(f"no cluster in {root}: run `pepsi cluster create`") from None
        return cls(Layout(root, int(saved["base_port"])))

    @property
    def created(self) -> bool:
        return self.layout.layout_file.exists()

    def create(self) -> None:
        """Write the directory, secrets and configurations (nothing starts)."""
        from pepsi.db import embedded  # noqa: PLC0415  # slow import

        layout = self.layout
        if self.created:
            raise ClusterError(f"a cluster already exists in {layout.root}")
        _which("etcd")
        layout.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        owner = embedded.server_owner()
        found = Secrets(secrets.token_urlsafe(24), secrets.token_urlsafe(24))
        _write_private(layout.secrets_file, json.dumps(found.__dict__))
        _write_private(layout.passfile, f"*:*:*:{SUPERUSER}:{found.superuser}\n")
        bin_dir = embedded.bin_dir()
        for node in NODES:
            layout.node_dir(node).mkdir(mode=0o700, exist_ok=True)
            config = layout.patroni_config(node, found, bin_dir)
            # JSON is YAML: Patroni reads it as its configuration file.
            _write_private(layout.config_file(node), json.dumps(config, indent=2))
        layout.etcd_dir.mkdir(mode=0o700, exist_ok=True)
        if owner.name is not None:  # root: the server's user owns everything but the passfile
            for path in [layout.root, *layout.root.rglob("*")]:
                if path != layout.passfile:
                    os.chown(path, owner.uid, owner.gid)
            embedded.prepare_as_root(layout.root)
            for program in (Path(sys.executable).resolve(), Path(_patroni_package())):
                embedded.prepare_as_root(program)
        _write_private(layout.layout_file, json.dumps({"base_port": layout.base_port}))

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start what is not running; return once a primary takes writes with its quorum."""
        self._require_created()
        self._start_etcd()
        for node in NODES:
            self.start_node(node, wait=False)
        self.wait_healthy(timeout)
        self._ensure_database()

    def start_node(self, node: str, *, wait: bool = True, timeout: float = START_TIMEOUT) -> None:
        """Start one node's Patroni (a killed node rejoins as a standby)."""
        self._require_node(node)
        if alive(read_pid(self.layout.pid_file(node))):
            return
        stop_orphan_postmaster(self.layout.data_dir(node))
        command = [sys.executable, "-m", "patroni", str(self.layout.config_file(node))]
        self._spawn(command, self.layout.pid_file(node), self.layout.log_file(node))
        if wait:
            self.wait_member(node, timeout)

    def stop(self) -> None:
        """Stop the nodes (Patroni stops its PostgreSQL cleanly), then etcd."""
        for node in NODES:
            terminate(read_pid(self.layout.pid_file(node)), STOP_TIMEOUT)
            stop_orphan_postmaster(self.layout.data_dir(node))
        terminate(read_pid(self.layout.etcd_pid_file), STOP_TIMEOUT)

    def destroy(self) -> None:
        """Kill everything and remove the directory."""
        for node in NODES:
            self.kill(node)
        kill_tree(read_pid(self.layout.etcd_pid_file))
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def kill(self, node: str) -> None:
        """The host is gone: SIGKILL its Patroni and every PostgreSQL process."""
        self._require_node(node)
        kill_tree(read_pid(self.layout.pid_file(node)))
        kill_tree(postmaster_pid(self.layout.data_dir(node)))

    def kill_primary(self) -> str:
        """Kill the current primary's host; its name."""
        leader = self.leader()
        if leader is None:
            raise ClusterError("no primary to kill: the cluster has no leader now")
        self.kill(leader)
        return leader

    # -- state ---------------------------------------------------------------------

    def members(self) -> list[Member]:
        """The members as the first answering node's Patroni sees them; [] if none answers."""
        for node in NODES:
            if not alive(read_pid(self.layout.pid_file(node))):
                continue
            answer = _get_json(self.layout.api_url(node, "cluster"))
            if answer is not None:
                return [_member(m) for m in answer.get("members", [])]
        return []

    def leader(self) -> str | None:
        for member in self.members():
            if member.is_leader and member.state == "running":
                return member.name
        return None

    def running_nodes(self) -> list[str]:
        return [n for n in NODES if alive(read_pid(self.layout.pid_file(n)))]

    def synchronous_standby_names(self, node: str) -> str | None:
        """The node's setting as its server reports it; None if it does not answer."""
        import psycopg  # noqa: PLC0415

        try:
            with psycopg.connect(self.layout.node_dsn(node, "postgres"), connect_timeout=2) as c:
                row = c.execute(query("cluster_quorum_setting")).fetchone()
        except psycopg.Error:
            return None
        return str(row[0]) if row else None

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """A leader running and every started node streaming from it."""
        deadline = time.monotonic() + timeout
        while True:
            members = {m.name: m for m in self.members()}
            started = self.running_nodes()
            leaders = [m for m in members.values() if m.is_leader and m.state == "running"]
            streaming = [n for n in started if n in members and members[n].state == "streaming"]
            quorum = [m for m in members.values() if m.role in ("quorum_standby", "sync_standby")]
            # With standbys, Patroni names them in the quorum a loop after they stream.
            if leaders and len(streaming) == len(started) - 1 and (quorum or len(started) == 1):
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the cluster is not healthy after {timeout:.0f}s: "
                    f"{[(m.name, m.role, m.state) for m in members.values()]}"
                    f"; see {self.layout.root}/*/patroni.log"
                )
            time.sleep(POLL)

    def wait_member(self, node: str, timeout: float = START_TIMEOUT) -> None:
        """`node` is back: leader or streaming."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members():
                if member.name == node and (
                    member.state == "streaming" or (member.is_leader and member.state == "running")
                ):
                    return
            if time.monotonic() > deadline:
                states = [(m.name, m.role, m.state) for m in self.members()]
                raise ClusterError(
                    f"{node} did not rejoin within {timeout:.0f}s: {states}; the end of its"
                    f" Patroni log:\n{self._log_tail(node)}"
                )
            time.sleep(POLL)

    def _log_tail(self, node: str, lines: int = 15) -> str:
        """The last lines of `node`'s Patroni log (its directory may be gone by the time
        someone reads a failed test's report)."""
        try:
            text = self.layout.log_file(node).read_text(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -----------------------------------------------------------------

    def _require_created(self) -> None:
        if not self.created:
            raise ClusterError(f"no cluster in {self.layout.root}: run `pepsi cluster create`")

    def _require_node(self, node: str) -> None:
        if node not in NODES:
            raise ClusterError(f"no node {node!r}: the nodes are {', '.join(NODES)}")

    def _start_etcd(self) -> None:
        if alive(read_pid(self.layout.etcd_pid_file)):
            return
        command = [_which("etcd"), *self.layout.etcd_args()]
        self._spawn(command, self.layout.etcd_pid_file, self.layout.etcd_log_file)
        url = f"http://127.0.0.1:{self.layout.etcd_client_port}/health"
        deadline = time.monotonic() + 30
        while _get_json(url) is None:
            if time.monotonic() > deadline:
                raise ClusterError(f"etcd did not start: see {self.layout.etcd_log_file}")
            time.sleep(POLL)

    def _spawn(self, command: list[str], pid_file: Path, log_file: Path) -> None:
        from pepsi.db import embedded  # noqa: PLC0415

        owner = embedded.server_owner()
        identity: dict[str, Any] = {}
        if owner.name is not None:
            identity = {"user": owner.uid, "group": owner.gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PEPSI_"))}
        with log_file.open("ab") as log:
            if owner.name is not None:
                os.chown(log_file, owner.uid, owner.gid)
            process = subprocess.Popen(  # our own programs, no shell
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the command that started it
                cwd=self.layout.root,
                env=env,
                **identity,
            )
        STARTED[process.pid] = process
        _write_private(pid_file, f"{process.pid}\n")

    def _ensure_database(self) -> None:
        """The `pepsi` database exists on the primary, with this build's schema."""
        import psycopg  # noqa: PLC0415
        from psycopg import sql  # noqa: PLC0415

        from pepsi.db import schema  # noqa: PLC0415

        with psycopg.connect(self.layout.dsn("postgres"), autocommit=True) as conn:
            if not conn.execute(query("database_exists"), {"name": DATABASE}).fetchone():
                conn.execute(query("database_create").format(name=sql.Identifier(DATABASE)))
        with psycopg.connect(self.layout.dsn()) as conn:
            schema.install(conn)


def _patroni_package() -> str:
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec("patroni")
    if spec is None or spec.origin is None:
        raise ClusterError(
            "Patroni is not installed: run `python3 scripts/dev.py setup` "
            "(or pip install 'pepsi[cluster]')"
        )
    return str(Path(spec.origin).parent)


def _member(raw: dict[str, Any]) -> Member:
    lag = raw.get("lag")
    return Member(
        name=str(raw.get("name")),
        role=str(raw.get("role")),
        state=str(raw.get("state")),
        lag=lag if isinstance(lag, int) else None,
        timeline=raw.get("timeline"),
    )


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310  # loopback http
            return json.loads(answer.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
