"""The send buffer asked for on a connection's socket (no database needed)."""

from __future__ import annotations

import socket
from pathlib import Path

from pepsi.db.connect import SEND_BUFFER_BYTES, widen_send_buffer


def _granted(size: int) -> int:
    """What Linux grants for SO_SNDBUF = size: capped at wmem_max, then doubled."""
    cap = int(Path("/proc/sys/net/core/wmem_max").read_text())
    return 2 * min(size, cap)


def test_a_unix_socket_gets_the_larger_send_buffer() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        before = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        granted = widen_send_buffer(left.fileno())
        assert granted == left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert granted == max(before, _granted(SEND_BUFFER_BYTES))
        # the caller's socket is still open and usable: only a duplicate was closed
        left.sendall(b"ping")
        assert right.recv(4) == b"ping"


def test_a_buffer_already_larger_is_left_alone() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 1024)
        small = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert widen_send_buffer(left.fileno(), size=small // 2) == small


def test_tcp_keeps_its_own_tuning() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert widen_send_buffer(sock.fileno()) is None
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before


def test_not_a_socket_is_no_error(tmp_path: Path) -> None:
    with (tmp_path / "file").open("w") as handle:
        assert widen_send_buffer(handle.fileno()) is None
