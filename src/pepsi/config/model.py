"""The typed configuration: one frozen dataclass per section, defaults on them.

The defaults here are the only ones: the parsers leave a field unset when its
key is absent, and the code that acts on a setting takes it from these
objects instead of keeping a default of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from types import MappingProxyType
from typing import Any

OVERLAY_ORIGIN = "pepsi.config_override"
STAGE_PREFIX = "stage-"
MIB = 1024 * 1024
IPNetwork = IPv4Network | IPv6Network

# A stage's failure timing (W-3): the first host-failure retry after a
# minute, doubling up to an hour, for at most 120 hours in the system.
RETRY_DELAY = 60.0
RETRY_MAX_DELAY = 3600.0
MAX_LIFETIME = 120 * 3600.0
MAX_RUNTIME = 300.0


class Overflow(Enum):
    """What a publish does to a stage at MAX_LENGTH (R-3)."""

    REJECT_PUBLISH = "reject-publish"
    DROP_HEAD = "drop-head"


@dataclass(frozen=True)
class PepsiOptions:
    allow_fusion: bool = True
    share_telemetry: bool = False


@dataclass(frozen=True)
class DispatchOptions:
    config_file: Path | None = None
    poll_interval: float = 5.0
    stats_interval: float = 60.0
    fair_scheduling: bool = True
    fair_half_life: float = 60.0
    fair_fifo_percent: int = 10
    worker_idle_timeout: float = 5.0
    # Failure handling (W-4…W-7); the manual's timings, shortened only in tests.
    strike_delay: float = 60.0  # first strike pause; the second is twice as long
    db_error_pause: float = 30.0  # status 74: how long the message pauses
    tempfail_window: float = 300.0  # status 75: how long a halved cap lasts
    start_cooldown: float = 5.0  # a stage's rest after a worker died before ready
    metrics_address: tuple[str, int] | None = None  # Prometheus endpoint; off by default
    vacuum_after: int = 20_000  # stage passes between the dispatcher's VACUUMs; 0: never
    # Worker lifecycle and connection timings; the defaults suit production.
    lock_wait: float = 10.0  # a second dispatcher's wait for the singleton lock (P-1)
    worker_ready_timeout: float = 60.0  # a new worker's time to print `ready`
    worker_stop_timeout: float = 10.0  # a worker asked to finish (stdin closed)
    worker_kill_grace: float = 2.0  # at shutdown, between SIGTERM and SIGKILL
    # Cap of every reconnect backoff (pepsi.db.backoff: from 0.1 s, doubling, jittered):
    # Pepsi's share of a failover once the new primary takes connections.
    reconnect_max_delay: float = 1.0


def default_data_dir() -> Path:
    """Where the embedded server keeps its data unless DATA_DIR says otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pepsi" / "postgres"


@dataclass(frozen=True)
class PostgresOptions:
    dsn: str | None = None
    worker_dsn: str | None = None  # stage code's (a pepsi_worker login); None: the dispatcher's
    data_dir: Path = field(default_factory=default_data_dir)
    worker_synchronous_commit: bool = False
    pool_min_size: int = 1
    pool_max_size: int = 4
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class IngressOptions:
    """Publishing limits, and the SMTP/LMTP server `pepsi ingress --serve` (docs/mail.md)."""

    dedup_window: float = 24 * 3600.0
    max_message_size: int = 64 * MIB
    # The mail server: off until LISTEN or LMTP_LISTEN is set.
    listen: tuple[tuple[str, int], ...] = ()  # SMTP
    lmtp_listen: tuple[str, int] | Path | None = None  # HOST:PORT or a UNIX socket
    stage: str | None = None  # where every accepted message starts
    domains: tuple[str, ...] = ()  # accepted from anyone (lower case; ".d" = subdomains)
    relay_networks: tuple[IPNetwork, ...] = ()  # may send to any domain
    max_size: int = 25 * MIB  # SIZE: the largest message, as the client sends it
    max_recipients: int = 100
    hostname: str | None = None  # None: the machine's fully qualified name
    tls_cert: Path | None = None
    tls_key: Path | None = None
    timeout: float = 300.0  # a command, or a chunk of DATA, must arrive within this
    max_connections: int = 1000  # sessions at once; more are told 421 and closed
    client_connection_limit: int = 50  # sessions per client (an IPv6 one by /64); 0: none


@dataclass(frozen=True)
class AmqpOptions:
    """The dispatcher's AMQP 0-9-1 listener (issue 16; docs/amqp.md#connecting)."""

    listen: tuple[str, int] | None = None  # off by default
    heartbeat: int = 60  # seconds offered in connection.tune (RabbitMQ's default)
    frame_max: int = 131072  # RabbitMQ's default
    channel_max: int = 2047  # RabbitMQ's default
    handshake_timeout: float = 10.0  # accept to connection.open-ok
    max_message_size: int = 128 * MIB  # RabbitMQ's max_message_size default
    stages: tuple[str, ...] = ()  # stages of the file that are also queues in vhost /
    max_connections: int = 1000  # open at once, from all clients (before any login)
    client_connection_limit: int = 100  # open at once from one client address
    # bytes of bodies being received (header to batcher), in all and per connection
    publish_buffer: int = 512 * MIB
    connection_publish_buffer: int = 256 * MIB


@dataclass(frozen=True)
class WebOptions:
    """The web console (issue 17; docs/web.md): `pepsi web`, or the dispatcher's."""

    listen: tuple[str, int] | None = None  # the dispatcher serves it here; off by default
    password: str | None = None  # a scrypt hash (`pepsi web password`); None: no login
    read_only: bool = False  # no repairs, whoever logs in
    session_ttl: float = 12 * 3600.0  # seconds a login lasts
    public_url: str | None = None  # behind a TLS proxy: https://HOST[:PORT] the browsers use


@dataclass(frozen=True)
class BouncerOptions:
    sink: str | None = None  # a stage name; None: the table pepsi.dead_letter
    interval: float = 30.0


@dataclass(frozen=True)
class StageConfig:
    name: str
    program: str | None = None
    handler: str | None = None
    next: str | None = None
    parallelism: int = 4
    queue_limit: int = 512  # the most ids a worker holds; its window adapts below (P-6)
    max_messages: int = 100_000  # recycle a worker after this many (P-6); see docs/configuration.md
    max_runtime: float = MAX_RUNTIME
    max_lifetime: float = MAX_LIFETIME
    retry_delay: float = RETRY_DELAY  # first host-failure retry; doubles each time
    retry_max_delay: float = RETRY_MAX_DELAY
    bounce_stage: str | None = None
    fusion: bool | None = None  # None: the stage's own default
    max_length: int | None = None
    overflow: Overflow = Overflow.REJECT_PUBLISH
    ttl: float | None = None
    # A built-in (`PROGRAM = pepsi-stage-NAME`): its name and its options as
    # parsed at load (a frozen object of `pepsi.stages.options`).
    builtin: str | None = None
    builtin_options: Any = None
    # the built-in's own keys as parsed from the section, (attr, value) sorted: what a
    # per-address override is laid over before the options are built again (W-9)
    builtin_values: tuple[tuple[str, Any], ...] = ()

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        """A built-in's extra edges, (KEY, stage), such as an if stage's THEN and ELSE."""
        routes: tuple[tuple[str, str], ...] = getattr(self.builtin_options, "routes", ())
        return routes

    @property
    def spawns(self) -> tuple[tuple[str, str], ...]:
        """A built-in's stages for the messages it makes, (KEY, stage): a relay's DSN_STAGE."""
        spawns: tuple[tuple[str, str], ...] = getattr(self.builtin_options, "spawns", ())
        return spawns

    @property
    def capacity(self) -> int:
        """Messages in flight at once for this stage (P-6, R-5)."""
        return self.parallelism * self.queue_limit


@dataclass(frozen=True)
class Config:
    path: Path | None
    pepsi: PepsiOptions = field(default_factory=PepsiOptions)
    dispatch: DispatchOptions = field(default_factory=DispatchOptions)
    postgres: PostgresOptions = field(default_factory=PostgresOptions)
    ingress: IngressOptions = field(default_factory=IngressOptions)
    bouncer: BouncerOptions = field(default_factory=BouncerOptions)
    amqp: AmqpOptions = field(default_factory=AmqpOptions)
    web: WebOptions = field(default_factory=WebOptions)
    stages: Mapping[str, StageConfig] = field(default_factory=lambda: MappingProxyType({}))
    warnings: tuple[str, ...] = ()

    def entry_stages(self) -> list[str]:
        """Stages no other stage advances, routes or bounces to: where publishing starts."""
        targets = {s.next for s in self.stages.values()} | {
            s.bounce_stage for s in self.stages.values()
        }
        targets.update(target for s in self.stages.values() for _, target in s.routes)
        return [name for name in self.stages if name not in targets]


# --------------------------------------------------------------------------
# Raw sections: every value remembers where it came from, for error messages.


@dataclass(frozen=True)
class RawValue:
    value: str
    origin: str  # a file name or OVERLAY_ORIGIN


RawSections = dict[str, dict[str, RawValue]]


def origin_of(keys: Mapping[str, RawValue], key: str, fallback: str | None) -> str | None:
    """Where `key` was set (for an error message), else `fallback`."""
    return keys[key].origin if key in keys else fallback
