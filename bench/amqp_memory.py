"""The dispatcher's memory under issue 34's probe: large publishes begun and never finished.

    .venv/bin/python bench/amqp_memory.py [--channels 6] [--size-mib 128] [--send-mib 128]

On a scratch database `pepsi_bench_amqp_memory` (the embedded or $PEPSI_DSN's server),
this process runs the AMQP listener and broker at the default [pepsi-amqp] settings on
a thread, as the dispatcher does, and measures its own RSS while a raw client:

  refused    as a user with no permission, on each of --channels channels, starts a
             --size-mib publish to an exchange that does not exist and sends --send-mib
             of its body anyway (the probe; before the fix: 80 MB -> 804 MB, kept after
             the socket closed)
  permitted  the same as a user allowed to write, to an existing queue, never finishing
             (what CONNECTION_PUBLISH_BUFFER and PUBLISH_BUFFER bound)

Prints RSS before, during and after the socket closed for each, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from typing import Any

import psutil
import psycopg
from common import scratch_database
from pamqp import commands

from pepsi.admin.accounts import amqp_users
from pepsi.amqp.broker.broker import Broker
from pepsi.amqp.session.server import serve
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.amqp.wire import methods, protocol, writer
from pepsi.amqp.wire.frames import MethodFrame
from pepsi.amqp.wire.reader import FrameReader

MIB = 1024 * 1024
PASSWORD = "bench-secret"
CHUNK = 128 * 1024 - protocol.FRAME_OVERHEAD


def rss() -> int:
    return psutil.Process().memory_info().rss // MIB


class Client:
    def __init__(self, port: int, user: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.reader = FrameReader(0, expect_protocol_header=False)
        self.sock.sendall(protocol.PROTOCOL_HEADER)
        self.expect(commands.Connection.Start)
        response = b"\0" + user.encode() + b"\0" + PASSWORD.encode()
        self.method(
            0,
            methods.build_method(
                commands.Connection.StartOk,
                client_properties={},
                mechanism="PLAIN",
                response=response,
                locale="en_US",
            ),
        )
        tune = self.expect(commands.Connection.Tune)
        self.method(
            0,
            methods.build_method(
                commands.Connection.TuneOk,
                channel_max=tune.channel_max,
                frame_max=tune.frame_max,
                heartbeat=0,
            ),
        )
        self.method(0, methods.build_method(commands.Connection.Open, virtual_host="/"))
        self.expect(commands.Connection.OpenOk)
        self.pending: list[Any] = []

    def method(self, channel: int, method: Any) -> None:
        self.sock.sendall(writer.encode_method(channel, method))

    def expect(self, cls: type[Any]) -> Any:
        while True:
            for frame in self.reader.feed(self.sock.recv(65536)):
                if isinstance(frame, MethodFrame) and isinstance(frame.method, cls):
                    return frame.method

    def probe(self, channels: int, exchange: str, key: str, size: int, send: int) -> None:
        self.sock.setblocking(False)  # the server may stop reading: send what it takes
        for channel in range(1, channels + 1):
            self._send(writer.encode_method(channel, methods.build_method(commands.Channel.Open)))
            self._send(
                writer.encode_method(
                    channel,
                    methods.build_method(
                        commands.Basic.Publish, exchange=exchange, routing_key=key
                    ),
                )
            )
            header = struct.pack(">HHQH", protocol.BASIC_CLASS_ID, 0, size, 0)
            self._send(writer.encode_frame(protocol.FRAME_HEADER, channel, header))
        frame = b"x" * CHUNK
        for _ in range(send // CHUNK):
            for channel in range(1, channels + 1):
                self._send(writer.encode_frame(protocol.FRAME_BODY, channel, frame))

    def _send(self, data: bytes) -> None:
        deadline = time.monotonic() + 2
        view = memoryview(data)
        while view and time.monotonic() < deadline:
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                time.sleep(0.001)
            with contextlib.suppress(BlockingIOError):
                self.sock.recv(65536)  # drop replies so the server never stalls on us

    def close(self) -> None:
        self.sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=6)
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--send-mib", type=int, default=128)
    args = parser.parse_args()
    dsn = scratch_database("pepsi_bench_amqp_memory")
    with psycopg.connect(dsn, autocommit=True) as conn:
        amqp_users.add_user(conn, "mallory", PASSWORD)
        amqp_users.set_permissions(conn, "mallory", "", "", "")
        amqp_users.add_user(conn, "alice", PASSWORD)
        amqp_users.set_permissions(conn, "alice", ".*", ".*", ".*")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    broker = Broker(dsn, 5.0)
    server = asyncio.run_coroutine_threadsafe(
        serve(("127.0.0.1", 0), ConnectionOptions(), dsn, 5.0, broker), loop
    ).result()
    port = server.address[1]
    setup = Client(port, "alice")
    setup.method(1, methods.build_method(commands.Channel.Open))
    setup.expect(commands.Channel.OpenOk)
    setup.method(1, methods.build_method(commands.Queue.Declare, queue="q"))
    setup.expect(commands.Queue.DeclareOk)
    setup.close()
    results: dict[str, dict[str, int]] = {}
    for name, user, exchange in (("refused", "mallory", "nowhere"), ("permitted", "alice", "")):
        before = rss()
        client = Client(port, user)
        client.probe(args.channels, exchange, "q", args.size_mib * MIB, args.send_mib * MIB)
        time.sleep(1)
        during = rss()
        held = asyncio.run_coroutine_threadsafe(_held(server), loop).result()
        client.close()
        time.sleep(2)
        results[name] = {
            "rss_before_mib": before,
            "rss_during_mib": during,
            "held_during_mib": held // MIB,
            "rss_after_close_mib": rss(),
            "held_after_close_mib": asyncio.run_coroutine_threadsafe(_held(server), loop).result()
            // MIB,
            "connections_after_close": len(server.connections),
        }
        print(name, results[name], flush=True)
    print(
        json.dumps(
            {
                "channels": args.channels,
                "size_mib": args.size_mib,
                "send_mib": args.send_mib,
                "results": results,
            },
            indent=2,
        )
    )


async def _held(server: Any) -> int:
    return int(server.memory.held)


if __name__ == "__main__":
    main()
