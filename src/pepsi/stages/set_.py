"""`pepsi-stage-set` (alias `pepsi-stage-tag`): write SET's state keys, go on to NEXT."""

from __future__ import annotations

from pepsi.stage import Advance, Message, stage
from pepsi.stages.options import SetOptions


@stage
def run(msg: Message) -> Advance:
    options: SetOptions = msg.options.builtin_options
    msg.state.update(options.values)
    return Advance()
