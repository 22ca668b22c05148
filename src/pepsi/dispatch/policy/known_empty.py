"""Stages a claim found empty, left out of the claims that only freed credit follows.

An AMQP consumer's ack frees its credit, and the read-ahead asks for a claim when it
runs low (`amqp.broker.consume.pump`). When the queue is empty that claim finds
nothing, and a Celery task (its message, its ack, its result) paid for such claims
besides the two that found its messages, and for a count(*) each time its client
declared its reply queue again: a round trip each.

The same holds for the last stage of a pipeline: a relay answers each message it
finished, and two claims in three after such answers found nothing (bench/mail.py).

A stage whose claim returned no row is known empty until news may have made a row
pending there: the AMQP listener's commit of a publish to it, or any other wakeup
but freed credit and a worker's answer that made no row pending (a NOTIFY, an
answer that advanced its message or that this build cannot read, a settle's
returns, a timer or the poll tick, a reconnection, the sweeper's resuming or
dead-lettering of rows), which counts for every stage.
A worker's split of a message and the messages it makes (delivery status
notifications) are pending rows too: their statements NOTIFY. A claim that found
nothing counts, and so does a stage the claim took rows of and left without a
pending one (`drained`, probed in the claim's statement after the claim);
otherwise a claim that found some says nothing about the rest (a
fair claim may leave rows of a crowded stage for the next one). News that comes
while a claim runs counts against what that claim found. Pure: the dispatcher
says what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pepsi.protocol import StatusLine

# A worker's last pass ended so: its row is gone, paused or failed, not pending anywhere
SETTLED = frozenset({"finish", "pause", "retry", "fail"})


def answer_is_news(status: StatusLine) -> bool:
    """Whether a worker's status line may mean a row became pending: its message
    advanced (to the next stage, or to BOUNCE_STAGE), or the line does not say (no
    report: another program, a build without outcomes, a status the dispatcher acts
    on itself)."""
    if status.status not in (0, 1) or not status.report:  # 1: the message failed
        return True
    return status.report[-1].outcome not in SETTLED  # a fused pass's last stage decided


class KnownEmpty:
    def __init__(self) -> None:
        self.stages: set[str] = set()
        self.news = True  # any stage may have rows pending since the last claim
        self.heard_since: set[str] = set()  # stages with news since the last claim began

    def heard(self) -> None:
        """A wakeup other than freed credit: every stage may have rows again."""
        self.news = True

    def heard_of(self, stages: Iterable[str]) -> None:
        """Rows were committed in these stages (the AMQP listener's publishes)."""
        self.stages.difference_update(stages)
        self.heard_since.update(stages)

    def empty(self, stage: str) -> bool:
        """No pending row for sure (queue.declare's message_count asks)."""
        return not self.news and stage in self.stages

    def room(self, capacities: Mapping[str, int]) -> dict[str, int]:
        """The capacities worth a claim now. Call it just before the claim: news that
        comes while the claim runs counts for the next one."""
        if self.news:
            self.news = False
            self.stages.clear()
        self.heard_since = set()
        return {s: n for s, n in capacities.items() if n > 0 and s not in self.stages}

    def claimed(
        self, asked: Iterable[str], found: Iterable[str], drained: Iterable[str] = ()
    ) -> None:
        """After a claim: the stages `asked` that `found` (the claimed rows' stages) lacks,
        and those it `drained`, unless news of them came meanwhile."""
        self.stages.update(set(asked).difference(found, self.heard_since))
        self.stages.update(set(drained).difference(self.heard_since))


__all__ = ["SETTLED", "KnownEmpty", "answer_is_news"]
