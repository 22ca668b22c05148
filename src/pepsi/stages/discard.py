"""`pepsi-stage-discard`: the message is finished here (its row is deleted)."""

from __future__ import annotations

from pepsi.stage import Finish, Message, stage


@stage
def run(msg: Message) -> Finish:
    del msg  # nothing to read: discarding is the whole stage
    return Finish()
