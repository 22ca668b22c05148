"""A Celery application for test_amqp_kombu.py: its worker runs this module against the
broker in $PEPSI_TEST_BROKER (a Pepsi dispatcher), with the RPC result backend."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

app = Celery("pepsi_test", broker=os.environ["PEPSI_TEST_BROKER"], backend="rpc://")
app.conf.broker_transport_options = {"confirm_publish": True}
app.conf.broker_connection_retry_on_startup = True


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task(bind=True, max_retries=2, default_retry_delay=0)
def flaky(self: Any, key: str) -> str:
    """Fails on its first run, succeeds on the retry (a retry is a new publish)."""
    retries: int = self.request.retries
    if retries == 0:
        raise self.retry(exc=RuntimeError(f"{key}: first try fails"))
    return f"{key} after {retries} retry"
