"""The worker's stdin reader (the outcome decisions are in test_worker_outcomes.py)."""

from __future__ import annotations

import os

from pepsi.worker.reader import IdReader


def test_reader_takes_what_is_buffered_without_blocking() -> None:
    read_fd, write_fd = os.pipe()
    try:
        reader = IdReader(read_fd)
        os.write(write_fd, b"1\n2\n3\n4\n5\n6")  # "6" is not a whole line yet
        assert reader.read_batch(4) == [1, 2, 3, 4]
        assert reader.read_batch(4) == [5]  # a lone id is returned at once
        os.write(write_fd, b"\n7\n")
        assert reader.read_batch(1) == [6]
        assert reader.read_batch(10) == [7]
        os.close(write_fd)
        write_fd = -1
        assert reader.read_batch(4) == []
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_reader_keeps_the_rows_of_the_batch_it_returns() -> None:
    read_fd, write_fd = os.pipe()
    try:
        reader = IdReader(read_fd)
        os.write(write_fd, b'1 ["a"]\n2\n3 ["c"]\n4\n')
        assert reader.read_batch(3) == [1, 2, 3]
        assert reader.rows == {1: b'["a"]', 3: b'["c"]'}
        assert reader.read_batch(3) == [4]
        assert reader.rows == {}  # the last batch's only
    finally:
        os.close(read_fd)
        os.close(write_fd)
