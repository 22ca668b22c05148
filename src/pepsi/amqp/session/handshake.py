"""The handshake: start / start-ok (SASL), tune / tune-ok, open, and connection.* after it.

protocol header → start / start-ok (SASL via the `Gatekeeper`) → tune / tune-ok
(`negotiation.negotiate_tune`) → open (vhost access via the `Gatekeeper`) →
open; the handshake must end within `handshake_timeout` of the accept (the
shell's timer). Once open, connection.close and update-secret are answered here.
"""

from __future__ import annotations

import logging
from typing import Self

from pamqp import base, commands

from pepsi.amqp.auth.permissions import MECHANISMS, SaslError, parse_response
from pepsi.amqp.session.channels import ChannelTable
from pepsi.amqp.session.closing import close_for
from pepsi.amqp.session.negotiation import negotiate_tune
from pepsi.amqp.session.shell import State
from pepsi.amqp.wire import methods, replies

log = logging.getLogger("pepsi.amqp")


class Handshake(ChannelTable):
    """The connection methods (channel 0), the handshake's among them."""

    async def _connection_method(self, method: base.Frame) -> None:
        state = self.state
        if isinstance(method, commands.Connection.Close):
            log.debug(
                "amqp %s: client closed: %s %s", self.name, method.reply_code, method.reply_text
            )
            await self._close_all_channels()
            self.send_method(0, commands.Connection.CloseOk())
            self._finish()
        elif isinstance(method, commands.Connection.CloseOk):
            pass  # not awaited (we sent no close): nothing to do
        elif isinstance(method, commands.Connection.StartOk) and state is State.START_OK:
            await self._start_ok(method)
        elif isinstance(method, commands.Connection.TuneOk) and state is State.TUNE_OK:
            self._tune_ok(method)
        elif isinstance(method, commands.Connection.Open) and state is State.OPEN_WAIT:
            await self._open(method)
        elif isinstance(method, commands.Connection.UpdateSecret) and state is State.OPEN:
            # A token refresh (OAuth 2). RabbitMQ's internal user database keeps the
            # connection's user as it is and says ok; so does Pepsi's.
            log.info("amqp %s: update-secret (%s): user unchanged", self.name, method.reason)
            self.send_method(0, commands.Connection.UpdateSecretOk())
        else:
            raise replies.AMQPConnectionError(
                replies.CHANNEL_ERROR,
                f"unexpected method {method.name} in connection state {state.name.lower()}",
                method.index >> 16,
                method.index & 0xFFFF,
            )

    async def _start_ok(self, method: commands.Connection.StartOk) -> None:
        properties = method.client_properties or {}
        capabilities = properties.get("capabilities") if isinstance(properties, dict) else None
        self.client_capabilities = dict(capabilities) if isinstance(capabilities, dict) else {}
        mechanism = str(method.mechanism)
        self.mechanism = mechanism
        if mechanism not in MECHANISMS:
            raise replies.AMQPConnectionError(
                replies.COMMAND_INVALID, f"unknown authentication mechanism '{mechanism}'"
            )
        self.state = State.SECURING
        try:
            credentials = parse_response(mechanism, method.response)
        except SaslError as error:
            refusal: str | None = f"unreadable {mechanism} response: {error}"
            username = "?"
        else:
            username = credentials.username
            refusal = await self.gatekeeper.login(credentials, self.peer)
        if self._lost:
            return
        if refusal is not None:
            log.warning("amqp %s: login refused: %s", self.name, refusal)
            await self._refuse_login()
            return
        self.username = username
        self.send_method(
            0,
            methods.build_method(
                commands.Connection.Tune,
                channel_max=self.options.amqp.channel_max,
                frame_max=self.options.amqp.frame_max,
                heartbeat=self.options.amqp.heartbeat,
            ),
        )
        self.state = State.TUNE_OK

    async def _refuse_login(self) -> None:
        # As RabbitMQ: a client that announced authentication_failure_close gets 403
        # before the socket closes; the others only see the socket close (the spec).
        if self.client_capabilities.get("authentication_failure_close"):
            error = replies.AMQPConnectionError(
                replies.ACCESS_REFUSED,
                f"Login was refused using authentication mechanism {self.mechanism}. "
                "For details see the broker logfile.",
            )
            await self._answer(close_for(error))
            return
        self.state = State.CLOSED
        self._close_transport()

    def _tune_ok(self, method: commands.Connection.TuneOk) -> None:
        amqp = self.options.amqp
        tuned = negotiate_tune(
            amqp.channel_max, amqp.frame_max, method.channel_max, method.frame_max, method.heartbeat
        )
        self.channel_max, self.frame_max, self.heartbeat = (
            tuned.channel_max,
            tuned.frame_max,
            tuned.heartbeat,
        )
        self._reader.frame_max = tuned.frame_max
        self.state = State.OPEN_WAIT
        if tuned.heartbeat > 0:
            self._last_received = self._loop.time()
            self._timers["heartbeat"] = self._loop.call_later(
                tuned.heartbeat / 2, self._heartbeat_tick
            )

    async def _open(self: Self, method: commands.Connection.Open) -> None:
        assert self.username is not None
        vhost = str(method.virtual_host)
        self.permission = await self.gatekeeper.vhost_permission(self.username, vhost)
        if self._lost:
            return
        self.vhost = vhost
        self.send_method(0, commands.Connection.OpenOk())
        self.state = State.OPEN
        self._cancel_timer("handshake")
        log.info("amqp %s: user '%s' opened vhost '%s'", self.name, self.username, vhost)
        self._opened_cb(self)
        self.set_blocked(self._blocked_now())
