"""The console's pages, one module each; `register` adds them all."""

from __future__ import annotations

import importlib

from aiohttp import web

PAGES = ("overview", "stage", "message", "repair")  # modules of this package with `setup(app)`


def register(app: web.Application) -> None:
    for name in PAGES:
        module = importlib.import_module(f"pepsi.web.pages.{name}")
        module.setup(app)
