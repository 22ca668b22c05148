"""Accepted messages into shared commits, and each outcome as the reply to give.

Every session hands its message to one `Pipeline` of the ingress's
`AsyncPublisher`: what arrives while a commit is under way goes into the
next one, so concurrent sessions share commits (and one NOTIFY per commit),
with `synchronous_commit` on and, on a cluster, the quorum's confirm
(`pepsi.publishing`). A reply is `250` only once the commit is confirmed;
any doubt is `451 4.3.0`.
"""

from __future__ import annotations

import asyncio
import logging

from pepsi.errors import PepsiError
from pepsi.mail.protocol import replies
from pepsi.mail.protocol.replies import Reply
from pepsi.publishing import OutgoingMessage
from pepsi.publishing.async_client import AsyncPublisher
from pepsi.publishing.errors import InvalidMessage, Rejected
from pepsi.publishing.pipeline import Pipeline

log = logging.getLogger("pepsi.ingress")

# Messages in commits at once; sessions past it wait for a slot before their reply.
MAX_OUTSTANDING = 1000
MAX_BATCH = 200  # messages per commit
# Commits under way at once. One: what arrives during a commit waits for the next, so
# each commit takes more (under smtp-source -s 20: 5.2 messages a commit instead of
# 3.7 with two, and 10 % more messages a second on two cores).
COMMITTERS = 1


def reply_for(error: BaseException) -> Reply:
    """The reply to a message whose commit failed with `error`."""
    if isinstance(error, Rejected):
        return replies.STAGE_FULL  # reject-publish at the first stage's MAX_LENGTH
    if isinstance(error, InvalidMessage):
        return replies.BAD_CONTENT  # the publisher's own limits (never reached in practice)
    return replies.NOT_STORED  # unreachable, lost confirm, refused, or a bug: never 250


class Committer:
    """`commit(message)` → the reply: `250 … queued as ID` once it is confirmed."""

    def __init__(self, publisher: AsyncPublisher) -> None:
        self.publisher = publisher
        self.pipeline: Pipeline | None = None
        self.stored = 0  # messages answered 250

    @property
    def commits(self) -> int:
        return 0 if self.pipeline is None else self.pipeline.batches

    def start(self) -> None:
        self.pipeline = self.publisher.pipeline(
            max_outstanding=MAX_OUTSTANDING, max_batch=MAX_BATCH, concurrency=COMMITTERS
        )

    async def commit(self, message: OutgoingMessage, queue_id: str) -> tuple[Reply, int | None]:
        """The reply for `message`, and its workqueue id when it was stored."""
        assert self.pipeline is not None, "start() first"
        try:
            future = await self.pipeline.submit(message)
            # Shielded: a client that goes away does not take its message out of a
            # commit that is under way (nor release its slot before that commit ends).
            workqueue_id = await asyncio.shield(future)
        except asyncio.CancelledError:
            raise
        except PepsiError as exc:
            log.warning("id %s not stored: %s", queue_id, exc)
            return reply_for(exc), None
        except Exception:
            log.exception("id %s not stored", queue_id)
            return replies.NOT_STORED, None
        self.stored += 1
        return replies.queued(workqueue_id), workqueue_id

    async def close(self) -> None:
        """Wait for the commits under way, then stop."""
        if self.pipeline is not None:
            await self.pipeline.close()
