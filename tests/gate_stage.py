"""A stage module that refuses to load until the file named by $PEPSI_TEST_GATE exists.

Imported by a worker, it makes the worker exit 78 before ready (its handler
cannot be imported), like a configuration or schema that is not ready yet.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.stages import effect

if not Path(os.environ.get("PEPSI_TEST_GATE", "/nonexistent")).exists():
    raise RuntimeError("the gate is closed")

run = effect
