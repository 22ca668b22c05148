"""Stages the benchmarks run: no-op metadata-only stages, and a finisher that
tells the benchmark (NOTIFY bench_done) when a message completes."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import psycopg

from pepsi import Message, stage


@stage()
def noop(msg: Message) -> None:
    """Advance to NEXT, or finish at the last stage."""


@cache
def _notifier() -> psycopg.Connection[Any]:
    return psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)


@stage()
def finish_notify(msg: Message) -> None:
    _notifier().execute("SELECT pg_notify('bench_done', %s)", (str(msg.id),))


@stage()
def slow(msg: Message) -> None:
    """20 ms of work, then NEXT: messages are in flight whenever the benchmark looks."""
    import time  # noqa: PLC0415

    time.sleep(0.02)
