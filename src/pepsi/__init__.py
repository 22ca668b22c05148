"""Pepsi: a durable message pipeline for Python, stored in PostgreSQL."""

from __future__ import annotations

from pepsi.errors import ConfigError, PepsiError

__version__ = "0.1.0"

__all__ = ["ConfigError", "PepsiError", "__version__"]
