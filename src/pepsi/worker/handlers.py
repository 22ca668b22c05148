"""Finding a stage's function: `HANDLER = package.module:function` (W-7).

A built-in (`PROGRAM = pepsi-stage-NAME`) arrives here with the handler its
registry names (`pepsi.stages.options.BUILTINS`), set by the configuration
parser: its module is imported like any other, only by its own workers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pepsi.config import StageConfig
from pepsi.errors import WorkerRefused
from pepsi.stage import Message

StageFunc = Callable[[Message], Any]
BUILTIN_PACKAGE = "pepsi.stages."


def load_handler(stage: StageConfig) -> StageFunc:
    """Import `package.module:function`; WorkerRefused if it is not there."""
    if stage.handler is None:
        raise WorkerRefused(
            "has no HANDLER: `pepsi worker` runs Python stages only",
            section=f"stage-{stage.name}",
        )
    module_name, _, attr = stage.handler.partition(":")
    where = {"section": f"stage-{stage.name}", "key": "HANDLER"}
    if stage.builtin is None and module_name.startswith(BUILTIN_PACKAGE):
        # Its options (IF, SET …) are parsed only for `PROGRAM = pepsi-stage-NAME`.
        raise WorkerRefused(
            "a built-in stage is set with PROGRAM = pepsi-stage-NAME, not HANDLER", **where
        )
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except ImportError as exc:
        raise WorkerRefused(f"cannot import {module_name}: {exc}", **where) from None
    except AttributeError:
        raise WorkerRefused(f"{module_name} has no {attr}", **where) from None
    except Exception as exc:  # noqa: BLE001  # a module failing at import: refuse (W-7)
        detail = f"{type(exc).__name__}: {exc}"
        raise WorkerRefused(f"importing {module_name} failed: {detail}", **where) from None
    if not callable(target):
        raise WorkerRefused(f"{stage.handler} is not callable", **where)
    check = getattr(stage.builtin_options, "check_at_start", None)
    if check is not None:  # a built-in's files (a key, a secret): readable, or refuse (W-3)
        try:
            check()
        except ValueError as exc:
            key = getattr(exc, "key", None)
            raise WorkerRefused(str(exc), section=f"stage-{stage.name}", key=key) from None
    func: StageFunc = target
    return func
