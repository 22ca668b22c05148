#!/usr/bin/env python3
"""A Pepsi stage in plain Python: psycopg and the worker protocol, nothing else.

Configure it as `PROGRAM = /path/to/protocol_worker.py`. The dispatcher starts
it with `worker` as its last argument and PEPSI_STAGE, PEPSI_DSN and
PEPSI_NEXT in the environment. It advances each message to the stage's NEXT,
or finishes it at the last stage.
"""

import os
import sys

import psycopg

stage = os.environ["PEPSI_STAGE"]
next_stage = os.environ.get("PEPSI_NEXT") or None
db = psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)
db.execute("SET synchronous_commit = off")  # a lost advance only repeats this stage
print("ready", flush=True)

for line in sys.stdin:  # one message id per line
    wid = int(line)
    if next_stage:  # advance: one UPDATE, guarded so a late write after a reset is a no-op
        db.execute(
            "UPDATE pepsi.workqueue SET stage = %s, status = 'pending'"
            " WHERE workqueue_id = %s AND status = 'running' AND stage = %s",
            (next_stage, wid, stage),
        )
    else:  # finish: delete the row
        db.execute(
            "DELETE FROM pepsi.workqueue"
            " WHERE workqueue_id = %s AND status = 'running' AND stage = %s",
            (wid, stage),
        )
    print(0, flush=True)  # one status line per id, in order
