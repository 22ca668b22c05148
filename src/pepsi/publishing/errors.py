"""Why a publish was refused: the classes live in `pepsi.errors` with every other error.

Re-exported here for the imports that name this module.
"""

from __future__ import annotations

from pepsi.errors import (
    InvalidMessage,
    NoRoute,
    NotConfirmed,
    NotOpen,
    PublishFailed,
    Rejected,
)

__all__ = ["InvalidMessage", "NoRoute", "NotConfirmed", "NotOpen", "PublishFailed", "Rejected"]
