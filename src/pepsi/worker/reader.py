"""Reading ids from stdin: one blocking, or every one already buffered (W-8); the rows
some carry (to a worker that said "ready rows") kept aside for the batch's load."""

from __future__ import annotations

import os
import select

from pepsi.protocol import parse_id_line

CHUNK = 65536


class IdReader:
    """Line reader over a file descriptor that can take what is buffered without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False
        self.rows: dict[int, bytes] = {}  # rows carried by the ids of the last batch

    def _take(self, line: bytes, ids: list[int]) -> None:
        wid, row = parse_id_line(line)
        ids.append(wid)
        if row is not None:
            self.rows[wid] = row

    def _fill(self, block: bool) -> None:
        if self.eof:
            return
        if not block:
            ready, _, _ = select.select([self.fd], [], [], 0)
            if not ready:
                return
        data = os.read(self.fd, CHUNK)
        if not data:
            self.eof = True
        self.buffer += data

    def _pop_line(self) -> bytes | None:
        newline = self.buffer.find(b"\n")
        if newline < 0:
            return None
        line, self.buffer = self.buffer[:newline], self.buffer[newline + 1 :]
        return line

    def read_batch(self, limit: int) -> list[int]:
        """Block for one id, then take up to `limit` in all without blocking.

        Returns [] at end of input. A lone id is returned at once: the
        non-blocking part stops the moment a read would block.
        """
        ids: list[int] = []
        self.rows = {}
        while not ids:
            line = self._pop_line()
            if line is not None:
                if line.strip():
                    self._take(line, ids)
                continue
            if self.eof:
                return []
            self._fill(block=True)
        while len(ids) < limit:
            line = self._pop_line()
            if line is None:
                if self.eof:
                    break
                before = len(self.buffer)
                self._fill(block=False)
                if len(self.buffer) == before and not self.eof:
                    break  # nothing more buffered: run what we have
                continue
            if line.strip():
                self._take(line, ids)
        return ids
