"""Publish batches of 50 until killed; print each batch number once confirmed."""

import sys
from pathlib import Path

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher

conf, dsn, first = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with Publisher(load_config(conf), dsn) as publisher:
    batch = first
    while True:
        publisher.publish_many(
            OutgoingMessage("inbound", b"x" * 1024, properties={"batch": batch}) for _ in range(50)
        )
        print(batch, flush=True)  # printed only after the commit returned: confirmed
        batch += 1
