"""Run the order pipeline end to end on the embedded server (or $PEPSI_DSN's).

In a database of its own, `pepsi_demo`, made anew at each run: the demo's
messages (a few fail on purpose) never land in the default database, where a
new user's own `pepsi top` would show them.

Starts the dispatcher, publishes orders in bursts, shows progress per stage,
prints what happened to every order, checks nothing is left in flight, and
stops the dispatcher cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import conninfo, sql
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pepsi.config import Config, load_config
from pepsi.db import connect, schema
from pepsi.errors import PepsiError
from pepsi.publishing import OutgoingMessage, Publisher

HERE = Path(__file__).resolve().parent
CONF = HERE / "pepsi.conf"
STAGES = ("validate", "price", "route", "ship")
DEMO_DATABASE = "pepsi_demo"


def order(n: int, rng: random.Random) -> bytes:
    if n % 200 == 7:  # a few malformed orders, to show a permanent failure
        return b'{"id": %d, "items": "lost in transit"}' % n
    items = [
        {"sku": f"SKU-{rng.randrange(1000):03d}", "qty": rng.randint(1, 5), "price": "9.90"}
        for _ in range(rng.randint(1, 4))
    ]
    return json.dumps({"id": n, "country": rng.choice(["FR", "DE", "IR"]), "items": items}).encode()


def demo_database(dsn: str) -> str:
    """`pepsi_demo` made anew on the server of `dsn`; its DSN. A role that may not create
    databases keeps `dsn`'s own (the demo then cleans up its stages there)."""
    admin = conninfo.make_conninfo(dsn, dbname="postgres")
    name = sql.Identifier(DEMO_DATABASE)
    try:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(name))
    except psycopg.errors.InsufficientPrivilege:
        return dsn
    return conninfo.make_conninfo(dsn, dbname=DEMO_DATABASE)


def prepare(console: Console) -> tuple[Config, str, psycopg.Connection[tuple[object, ...]]]:
    """Schema installed, the demo's ledger empty, leftovers of a previous run gone."""
    config = load_config(CONF)
    target = connect.resolve(config)
    dsn = demo_database(target.dsn)
    dbname = conninfo.conninfo_to_dict(dsn).get("dbname")
    console.print(f"database: {dbname} on the {target.source}")
    db = psycopg.connect(dsn, autocommit=True)
    console.print(schema.install(db))
    db.execute(
        "CREATE TABLE IF NOT EXISTS demo_shipments (order_id bigint PRIMARY KEY,"
        " warehouse text NOT NULL, total numeric NOT NULL)"
    )
    db.execute("TRUNCATE demo_shipments")
    db.execute("DELETE FROM pepsi.workqueue WHERE stage = ANY(%s)", (list(STAGES),))
    db.execute("DELETE FROM pepsi.publish_dedup WHERE message_id LIKE 'order-%'")
    return config, dsn, db


def feed(
    console: Console,
    publisher: Publisher,
    db: psycopg.Connection[tuple[object, ...]],
    dispatcher: subprocess.Popen[bytes],
    *,
    orders: int,
    burst: int,
) -> bool:
    """Publish the orders in bursts and follow them until none is in flight."""
    rng = random.Random(42)  # noqa: S311  # demo data, not secrets
    columns = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        published = progress.add_task("published", total=orders)
        done = progress.add_task("done", total=orders)
        n = 0
        while n < orders or remaining(db) > 0:
            if n < orders:
                size = min(burst, orders - n)
                publisher.publish_many(  # one burst = one transaction, one NOTIFY
                    OutgoingMessage(
                        "validate",
                        order(i, rng),
                        content_type="application/json",
                        message_id=f"order-{i}",
                        dedup=True,
                    )
                    for i in range(n, n + size)
                )
                n += size
                progress.update(published, completed=n)
            progress.update(done, completed=n - remaining(db))
            if dispatcher.poll() is not None:
                return False
            if n >= orders:
                time.sleep(0.1)
        progress.update(done, completed=n - remaining(db))
    return True


def report(
    console: Console,
    db: psycopg.Connection[tuple[object, ...]],
    orders: int,
    elapsed: float,
    code: int,
) -> bool:
    """Print what happened at each stage; True if every order is accounted for."""
    shipped = int(str(scalar(db, "SELECT count(*) FROM demo_shipments")))
    failed_at = {
        str(s): int(str(c))
        for s, c in db.execute(
            "SELECT state->>'failed_stage', count(*) FROM pepsi.workqueue"
            " WHERE status = 'failed' AND stage = ANY(%s) GROUP BY 1",
            (list(STAGES),),
        ).fetchall()
    }
    in_flight = remaining(db)
    table = Table(title="orders through each stage", title_justify="left")
    for column in ("stage", "passed", "failed"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    passed = orders
    for stage in STAGES:
        passed -= failed_at.get(stage, 0)
        table.add_row(stage, str(passed), str(failed_at.get(stage, 0)))
    console.print(table)
    failed = sum(failed_at.values())
    console.print(
        f"{orders} orders in {elapsed:.1f}s ({orders / elapsed:.0f}/s): {shipped} shipped, "
        f"{failed} failed permanently (kept for inspection), {in_flight} still in the queue"
    )
    ok = in_flight == 0 and shipped + failed == orders and code == 0
    verdict = "[green]every order accounted for[/]" if ok else "[red]something is missing[/]"
    console.print(f"dispatcher stopped with status {code}; {verdict}")
    return ok


def where(console: Console, dsn: str) -> None:
    """How to look at the demo's database with the usual commands."""
    if conninfo.conninfo_to_dict(dsn).get("dbname") == DEMO_DATABASE:
        console.print(
            f"the demo's messages are in the database {DEMO_DATABASE} (the default one is "
            f"untouched); to look: PEPSI_DSN='{dsn}' .venv/bin/pepsi queue status",
            soft_wrap=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=3000, help="orders to publish")
    parser.add_argument("--burst", type=int, default=250, help="orders per transaction")
    args = parser.parse_args()
    console = Console()
    try:
        config, dsn, db = prepare(console)
    except PepsiError as exc:  # no database, or a schema of another build: one line
        console.print(f"[red]{exc}[/]")
        return exc.exit_code
    log = HERE / "dispatch.log"
    with log.open("wb") as log_file:
        dispatcher = subprocess.Popen(
            [sys.executable, "-m", "pepsi", "-c", str(CONF), "dispatch", "serve"],
            env={**os.environ, "PEPSI_DSN": dsn},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    console.print(f"dispatcher started (pid {dispatcher.pid}, log {log})")
    started = time.monotonic()
    try:
        with Publisher(config, dsn) as publisher:
            fed = feed(console, publisher, db, dispatcher, orders=args.orders, burst=args.burst)
        elapsed = time.monotonic() - started
    finally:
        if dispatcher.poll() is None:
            dispatcher.send_signal(signal.SIGTERM)
        code = dispatcher.wait(timeout=60)
    if not fed:
        console.print(f"[red]the dispatcher exited with status {code}; see {log}[/]")
        return 1
    ok = report(console, db, args.orders, elapsed, code)
    where(console, dsn)
    return 0 if ok else 1


def scalar(db: psycopg.Connection[tuple[object, ...]], query: str) -> object:
    row = db.execute(query).fetchone()
    return row[0] if row else None


def remaining(db: psycopg.Connection[tuple[object, ...]]) -> int:
    row = db.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE status <> 'failed' AND stage = ANY(%s)",
        (list(STAGES),),
    ).fetchone()
    return int(str(row[0])) if row else 0


if __name__ == "__main__":
    sys.exit(main())
