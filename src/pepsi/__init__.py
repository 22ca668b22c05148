"""Pepsi: a durable message pipeline for Python, stored in PostgreSQL."""

from __future__ import annotations

from pepsi.errors import ConfigError, PepsiError
from pepsi.stage import (
    Advance,
    Finish,
    Message,
    Needs,
    Outcome,
    Pause,
    PermanentError,
    stage,
)

__version__ = "0.1.0"

__all__ = [
    "Advance",
    "ConfigError",
    "Finish",
    "Message",
    "Needs",
    "Outcome",
    "Pause",
    "PepsiError",
    "PermanentError",
    "__version__",
    "stage",
]
