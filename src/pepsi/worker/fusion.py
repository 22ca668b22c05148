"""Stage fusion (W-10): when an advance runs its successor in the same worker. Pure.

A metadata-only stage that advances to a successor which needs no more
than is already loaded runs that successor on the loaded row, in the same
process: one SELECT, the stages' work, one terminal write, one status line
with a report entry per stage. A successor is fused only when all of these
hold; any miss makes the advance an ordinary dispatched hop, so fusion never
changes a message's outcome, only whether the hand-over touches the database:

- `[pepsi] ALLOW_FUSION` (default yes);
- the successor's `FUSION` (default: yes for built-in stages, no for others);
- the successor runs in the unified program (a HANDLER or a built-in);
- it needs no more of the message than is loaded (metadata < header < body);
- the stage did not refuse fusion for this message (`Advance(fuse=False)`);
- no stage of the chain rewrote the message (its metadata, header block or
  body) while it still has more than one recipient: a later split clones
  its rows from the stored row, which must carry the rewrite (the manual);
- the successor has no per-address overrides (those are applied, and a
  split made, where the row is loaded: a dispatched hop);
- the successor is not transactional (`@stage(transactional=True)`, issue
  18: it runs in a transaction of its own, with its row's claim token); a
  transactional stage does not fuse its successors either;
- fewer than FUSION_DEPTH stages fused already (a misconfigured cycle).
"""

from __future__ import annotations

from pepsi.config import StageConfig
from pepsi.stage import Needs

FUSION_DEPTH = 8  # stages run in one pass at most; then the advance is written
_ORDER = {Needs.METADATA: 0, Needs.HEADER: 1, Needs.BODY: 2}


def fusable(stage: StageConfig) -> bool:
    """Whether `stage` may be fused into its predecessor's pass, by configuration."""
    if stage.handler is None:  # an external PROGRAM runs in its own process
        return False
    return stage.fusion if stage.fusion is not None else stage.builtin is not None


def may_fuse(
    successor: StageConfig,
    *,
    loaded: Needs,
    needs: Needs,
    depth: int,
    refused: bool,
    changed: bool,
    overridden: bool,
    transactional: bool = False,
) -> bool:
    """Whether this advance to `successor` runs it in the same pass (W-10)."""
    return (
        not refused
        and not changed
        and not overridden
        and not transactional
        and depth < FUSION_DEPTH
        and fusable(successor)
        and _ORDER[needs] <= _ORDER[loaded]
    )
