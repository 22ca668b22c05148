"""`pepsi-stage-bounce`: hand the message to the failure path, on purpose.

With a BOUNCE_STAGE the message goes there (pending), as a message whose
retries ran out would; without one it fails here at once, and the failure
bouncer (`pepsi failure-bouncer`) takes it to its sink. Either way the
state says why: `last_error` (REASON), `failed_stage`, `failure_class`.

With DSN_STAGE, a mail message (one with an envelope) is reported to its
sender instead: a failure delivery status notification for each recipient
that did not refuse one (NOTIFY), written into DSN_STAGE with the outcome,
and the message is finished. The report's reason is generic (its status:
4.4.7 once retries ran out, 5.0.0 otherwise); the error stays in the
message's state. A message that cannot be reported (the null sender, a
mailing-list copy) takes the path above.
"""

from __future__ import annotations

from pepsi.mail.relay import delivery
from pepsi.stage import Advance, Finish, Message, Part, PermanentError, Split, stage
from pepsi.stages.mail_options import machine_name
from pepsi.stages.options import BounceOptions
from pepsi.worker.outcomes import RETRIES_EXHAUSTED

FAILURE_CLASS = "permanent"  # what a PermanentError records, so both paths agree
EXPIRED = "4.4.7"  # RFC 3463: delivery time expired


@stage
def run(msg: Message) -> Advance | Split | Finish:
    options: BounceOptions = msg.options.builtin_options
    # decided before the context is built: that reads the header block and body
    if msg.recipients and delivery.may_report(options.dsn_stage, msg.sender, msg.state):
        context = delivery.Context.of(
            msg, dsn_stage=options.dsn_stage, delay_dsn_after=0.0,
            hostname=options.hostname or machine_name(),
        )  # fmt: skip
        status = EXPIRED if msg.state.get("failure_class") == RETRIES_EXHAUSTED else "5.0.0"
        report = delivery.failure_report(context, status)
        if report is None:  # every recipient's NOTIFY refused a report
            return Finish()
        return Split((Part(tuple(msg.recipients), Finish()),), spawn=(report,))
    reason = options.reason or f"bounced at stage {msg.stage}"
    target = msg.options.bounce_stage
    if target is None:
        raise PermanentError(reason)  # failed here: the failure bouncer's to take
    msg.state.update(last_error=reason, failed_stage=msg.stage, failure_class=FAILURE_CLASS)
    return Advance(target)
