"""The Celery application of bench/amqp.py's Celery cell: one `add` task, the `rpc://`
result backend, late acks. Its worker runs this module (`celery -A amqp_celery worker`)
against the broker in $BENCH_CELERY_BROKER; the benchmark builds its own app the same way.
"""

from __future__ import annotations

import os

from celery import Celery


def make_app(broker_url: str) -> Celery:
    app = Celery("pepsi_bench", broker=broker_url, backend="rpc://")
    app.conf.task_acks_late = True  # acked once the task has run, not when received
    app.conf.broker_connection_retry_on_startup = True

    @app.task(name="bench.add", shared=False)  # one registration per app, not global
    def add(x: int, y: int) -> int:
        return x + y

    return app


app = make_app(os.environ.get("BENCH_CELERY_BROKER", "amqp://"))
