"""`pepsi-stage-if`: go to THEN when IF holds, else to ELSE (or NEXT; finish without)."""

from __future__ import annotations

from pepsi.stage import Advance, Message, stage
from pepsi.stages.evaluation import evaluate
from pepsi.stages.options import IfOptions


@stage
def run(msg: Message) -> Advance:
    options: IfOptions = msg.options.builtin_options
    if evaluate(options.condition, msg):
        return Advance(options.then)
    return Advance(options.otherwise)  # None: NEXT, or finish without one
