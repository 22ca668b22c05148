"""What the dispatcher serves besides its loop: metrics, the AMQP listener, the web console.

Each is off unless its LISTEN (or METRICS_ADDRESS) is set, runs on the
dispatcher's event loop, and refuses an address it cannot listen on with a
ConfigError naming its key. `Endpoints` is a base of `Dispatcher`, which
builds the services these read and starts them in `serve`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from pepsi.admin.horizon import Probe
from pepsi.amqp.broker.broker import Broker as AmqpBroker
from pepsi.amqp.session import server as amqp_server
from pepsi.config import Config, Overflow
from pepsi.config.values import host_port, is_loopback
from pepsi.dispatch.ledger import InFlight
from pepsi.dispatch.policy.known_pending import KnownPending
from pepsi.dispatch.pools.supervisor import PoolSupervisor
from pepsi.dispatch.services.metrics import Gauges, MetricsServer, Snapshot
from pepsi.dispatch.stats import Stats
from pepsi.errors import ConfigError

log = logging.getLogger("pepsi.dispatch")


class _AmqpLink:
    """What the AMQP deliverer tells the dispatcher (amqp.broker.consume.state.DispatchLink)."""

    def __init__(self, dispatcher: Endpoints) -> None:
        self.dispatcher = dispatcher
        self.returned = dispatcher.ledger.returned
        self.consumed = dispatcher.ledger.consumed
        self.direct = dispatcher.ledger.claimed_direct

    def wake(self, cause: str) -> None:
        # consumers are workers to the statistics (P-9); "credit" brings no pending row
        self.dispatcher.wake("worker", news=cause != "credit")

    def known_pending(self, stage: str) -> int | None:
        return self.dispatcher.known.pending(stage)

    def changed(self, stage: str) -> None:
        self.dispatcher.known.changed((stage,))

    def claim_turn(self) -> int:
        return self.dispatcher.claim_turns

    async def between_claims(self) -> int:
        await self.dispatcher.no_claim.wait()
        return self.dispatcher.claim_turns


class Endpoints:
    """The dispatcher's listeners and the numbers its metrics report; a base of
    `Dispatcher`, which sets these attributes."""

    config: Config
    dsn: str
    clock: Callable[[], float]
    started_at: datetime
    stats: Stats
    ledger: InFlight
    supervisor: PoolSupervisor
    amqp_broker: AmqpBroker | None

    known: KnownPending
    claim_turns: int
    no_claim: asyncio.Event

    def wake(self, cause: str, *, news: bool | Mapping[str, int | None] = True) -> None: ...

    def _orphans_possible(self) -> None: ...

    def _serve_metrics(self) -> MetricsServer | None:
        address = self.config.dispatch.metrics_address
        if address is None:
            return None
        if not is_loopback(address[0]):
            log.warning(
                "metrics at %s answer anyone who can reach that address (the endpoint has "
                "no authentication): keep METRICS_ADDRESS on loopback, or firewall it",
                host_port(*address),
            )
        try:
            # the oldest transaction is read on the scrape's thread, on its own connection
            horizon = Probe(self.dsn, timeout=min(self.config.postgres.connect_timeout, 5.0))
            server = MetricsServer(
                address, self._metrics_snapshot, list(self.supervisor.pools), horizon=horizon
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {address[0]}:{address[1]}: {exc.strerror or exc}",
                section="pepsi-dispatch",
                key="METRICS_ADDRESS",
            ) from None
        log.info("metrics at %s", server.url)
        return server

    async def _serve_amqp(self) -> amqp_server.Server | None:
        """The AMQP listener ([pepsi-amqp] LISTEN), served on this loop; None when off."""
        options = self.config.amqp
        if options.listen is None:
            return None
        limits = {  # a stage of STAGES keeps its MAX_LENGTH and OVERFLOW for AMQP publishes
            name: (stage.max_length, stage.overflow is Overflow.DROP_HEAD)
            for name in options.stages
            if (stage := self.config.stages.get(name)) is not None and stage.max_length is not None
        }
        self.amqp_broker = AmqpBroker(
            self.dsn, self.config.postgres.connect_timeout, entries=options.stages,
            entry_limits=limits,
        )  # fmt: skip
        self.amqp_broker.deliverer.link = _AmqpLink(self)
        # AMQP publishes are written by this process: they wake this loop, not NOTIFY (P-3)
        self.amqp_broker.batcher.on_committed = lambda rows: self.wake("notify", news=rows)
        # rows for waiting consumers are written running by their publish (direct delivery)
        self.amqp_broker.batcher.direct = self.amqp_broker.deliverer
        self.amqp_broker.batcher.on_orphans = self._orphans_possible
        await self.amqp_broker.drop_transient()
        await self.amqp_broker.declare_entries()
        try:
            server = await amqp_server.serve(
                options.listen,
                amqp_server.ConnectionOptions(options),
                self.dsn,
                self.config.postgres.connect_timeout,
                self.amqp_broker,
            )
        except OSError as exc:
            host, port = options.listen
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                section="pepsi-amqp",
                key="LISTEN",
            ) from None
        self.amqp_broker.batcher.on_blocked = server.set_blocked  # connection.blocked
        host, port = server.address
        log.info("amqp listening on %s", host_port(host, port))
        return server

    async def _serve_web(self) -> Any:
        """The web console ([pepsi-web] LISTEN), served on this loop; None when off."""
        address = self.config.web.listen
        if address is None:
            return None
        from pepsi.web import server  # noqa: PLC0415  # aiohttp only when serving

        try:
            running = await server.start(
                self.config, self.dsn, address, dispatcher=self, publish_as="pepsi dispatch"
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {address[0]}:{address[1]}: {exc.strerror or exc}",
                section="pepsi-web",
                key="LISTEN",
            ) from None
        if running.token is None:
            log.info("web console at %s", running.url)
        else:  # the token stays out of the log: its file is the owner's only
            log.info("web console at %s (`pepsi web url` prints its link)", running.url)
        return running

    def _metrics_snapshot(self) -> Snapshot:
        """Counters since start and the pools' gauges, taken on the loop."""
        now = self.clock()
        pools = self.supervisor.pools
        return Snapshot(
            self.stats.snapshot(),
            Gauges(
                workers={name: len(pool.workers) for name, pool in pools.items()},
                in_flight={
                    name: sum(len(w.inflight) for w in pool.workers.values())
                    for name, pool in pools.items()
                },
                worker_limit={
                    name: pool.limit(self.supervisor.cap(name, now)) for name, pool in pools.items()
                },
                started=self.started_at.timestamp(),
                executing=tuple(
                    sorted(
                        w.inflight[0]
                        for pool in pools.values()
                        for w in pool.workers.values()
                        if w.ready and w.inflight
                    )
                ),
            ),
        )
