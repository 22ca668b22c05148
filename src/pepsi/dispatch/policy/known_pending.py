"""What the dispatcher knows of stages' pending rows: none, or how many, until news.

An AMQP consumer's ack frees its credit, and the read-ahead asks for a claim when it
runs low (`amqp.broker.consume.pump`). When the queue is empty that claim finds
nothing, and a Celery task (its message, its ack, its result) paid for such claims
besides the two that found its messages, and for a count(*) each time its client
declared its reply queue again (before every task: kombu does not cache the
declaration of an auto-delete queue), a round trip each.

The same holds for the last stage of a pipeline: a relay answers each message it
finished, and two claims in three after such answers found nothing (bench/mail.py).

A stage whose claim returned no row is known empty, and so is a stage the claim took
rows of and left without a pending one (`drained`, probed in the claim's statement
after the claim); otherwise a claim that found some says nothing about the rest (a
fair claim may leave rows of a crowded stage for the next one), unless the count
was known before: then it is that count less the rows taken. Known empty stages are
left out of the claims that only freed credit asks for.

A known count lasts until news may have changed it:
- the AMQP listener's commit of publishes adds its rows to their stages' counts
  (`published`); a stage with a length limit or a deduplicated row is not counted,
  as the publish function may have dropped rows;
- rows made pending or taken here other than by the claim (requeued by the
  dispatcher, basic.get, purged, their queue deleted, expired) make their stages'
  counts unknown (`changed`);
- any other wakeup but freed credit and a worker's answer that made no row pending
  (a NOTIFY, an answer that advanced its message or that this build cannot read, a
  settle's returns, a timer or the poll tick, a reconnection, a catalogue change,
  the sweeper's poll) makes every count unknown (`heard`).
A worker's split of a message and the messages it makes (delivery status
notifications) are pending rows too: their statements NOTIFY. News that comes while
a claim runs counts against what that claim found. Pure: the dispatcher says what
happened.
"""

from __future__ import annotations

from collections import Counter
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


class KnownPending:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}  # stage -> its pending rows, where known
        self.news = True  # any stage may have changed since the last claim
        self.heard_since: set[str] = set()  # stages with news since the last claim began

    def heard(self) -> None:
        """A wakeup other than freed credit: every count is unknown."""
        self.news = True

    def changed(self, stages: Iterable[str]) -> None:
        """Rows of these stages became pending, or were taken, by how many not known."""
        for stage in stages:
            self.counts.pop(stage, None)
            self.heard_since.add(stage)

    def published(self, rows: Mapping[str, int | None]) -> None:
        """The AMQP listener committed `rows` new pending rows per stage (None: not known
        how many)."""
        for stage, n in rows.items():
            known = self.counts.get(stage)
            if known is not None and n is not None:
                self.counts[stage] = known + n
            else:
                self.counts.pop(stage, None)
            self.heard_since.add(stage)

    def pending(self, stage: str) -> int | None:
        """The stage's pending rows for sure (queue.declare's message_count asks), or None."""
        return None if self.news else self.counts.get(stage)

    def room(self, capacities: Mapping[str, int]) -> dict[str, int]:
        """The capacities worth a claim now. Call it just before the claim: news that
        comes while the claim runs counts for the next one."""
        if self.news:
            self.news = False
            self.counts.clear()
        self.heard_since = set()
        return {s: n for s, n in capacities.items() if n > 0 and self.counts.get(s) != 0}

    def claimed(
        self, asked: Iterable[str], found: Iterable[str], drained: Iterable[str] = ()
    ) -> None:
        """After a claim: the stages `asked`, `found` (one per claimed row) and those the
        claim `drained`. What the claim saw is the count unless news came meanwhile;
        a count known when it began, plus the listener's commits since, less the rows
        it took, is the count whatever the claim saw of those commits."""
        taken = Counter(found)
        drained = set(drained)
        for stage in asked:
            known = self.counts.get(stage)
            if stage not in self.heard_since and (stage in drained or not taken[stage]):
                self.counts[stage] = 0
            elif known is not None and known >= taken[stage]:
                self.counts[stage] = known - taken[stage]
            else:  # not known, or rows went another way meanwhile
                self.counts.pop(stage, None)


__all__ = ["SETTLED", "KnownPending", "answer_is_news"]
