"""`pepsi-stage-bounce`: hand the message to the failure path, on purpose.

With a BOUNCE_STAGE the message goes there (pending), as a message whose
retries ran out would; without one it fails here at once, and the failure
bouncer (`pepsi failure-bouncer`) takes it to its sink. Either way the
state says why: `last_error` (REASON), `failed_stage`, `failure_class`.
"""

from __future__ import annotations

from pepsi.stage import Advance, Message, PermanentError, stage
from pepsi.stages.options import BounceOptions

FAILURE_CLASS = "permanent"  # what a PermanentError records, so both paths agree


@stage
def run(msg: Message) -> Advance:
    options: BounceOptions = msg.options.builtin_options
    reason = options.reason or f"bounced at stage {msg.stage}"
    target = msg.options.bounce_stage
    if target is None:
        raise PermanentError(reason)  # failed here: the failure bouncer's to take
    msg.state.update(last_error=reason, failed_stage=msg.stage, failure_class=FAILURE_CLASS)
    return Advance(target)
