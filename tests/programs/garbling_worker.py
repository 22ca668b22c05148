"""A protocol worker that answers its first message with garbage, once per marker file."""

import os
import sys
from pathlib import Path

import psycopg

marker = Path(sys.argv[1])
stage = os.environ["PEPSI_STAGE"]
db = psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)
print("ready", flush=True)
for line in sys.stdin:
    wid = int(line)
    if not marker.exists():
        marker.write_text("garbled")
        print("this is not a status", flush=True)
        continue
    db.execute(
        "DELETE FROM pepsi.workqueue WHERE workqueue_id = %s AND status = 'running' AND stage = %s",
        (wid, stage),
    )
    print(0, flush=True)
