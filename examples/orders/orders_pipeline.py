"""The demo's stages: a small order pipeline.

validate (reads the JSON body) -> price -> route -> ship (records a shipment).
"""

from __future__ import annotations

import json
import os
from decimal import Decimal
from functools import cache
from typing import Any

import psycopg

from pepsi import Message, PermanentError, stage

TAX = {"FR": Decimal("0.20"), "DE": Decimal("0.19"), "IR": Decimal("0.10")}
WAREHOUSES = {"FR": "lyon", "DE": "leipzig", "IR": "tabriz"}


@stage(needs="body")
def validate(msg: Message) -> None:
    try:
        order = json.loads(msg.body or b"")
        items = [(str(i["sku"]), int(i["qty"]), str(i["price"])) for i in order["items"]]
        country = str(order["country"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PermanentError(f"not an order: {exc}") from None
    if not items or country not in TAX:
        raise PermanentError(f"cannot ship {len(items)} items to {country!r}")
    msg.state.update(order_id=order["id"], items=items, country=country)


@stage()
def price(msg: Message) -> None:
    subtotal = sum(Decimal(p) * q for _, q, p in msg.state["items"])
    total = subtotal * (1 + TAX[msg.state["country"]])
    msg.state["total"] = str(total.quantize(Decimal("0.01")))


@stage()
def route(msg: Message) -> None:
    msg.state["warehouse"] = WAREHOUSES[msg.state["country"]]


@cache
def _ledger() -> psycopg.Connection[Any]:
    conn = psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)
    # Like the worker's own writes: a lost shipment record repeats the stage,
    # and the insert is idempotent.
    conn.execute("SET synchronous_commit = off")
    return conn


@stage()
def ship(msg: Message) -> None:
    # The shipment is recorded idempotently: a repeated stage (at-least-once)
    # finds the order already shipped.
    _ledger().execute(
        "INSERT INTO demo_shipments (order_id, warehouse, total) VALUES (%s, %s, %s)"
        " ON CONFLICT (order_id) DO NOTHING",
        (msg.state["order_id"], msg.state["warehouse"], msg.state["total"]),
    )
