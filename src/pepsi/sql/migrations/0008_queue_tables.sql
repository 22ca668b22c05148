-- 0008: the queue tables under load. Vacuum never truncates them: a vacuum
-- that finds the end of a drained queue empty would take an exclusive lock on
-- it (retried for up to 5 s) to cut pages the next burst extends again. The
-- body-release trigger fires only for rows that have a body: a metadata-only
-- message's delete no longer calls a plpgsql function (15 % of a batched
-- delete's cost per row). The oldest-first claim becomes a function, for the
-- planner settings that keep it on its index whatever the statistics say.

ALTER TABLE pepsi.workqueue SET (vacuum_truncate = false);
ALTER TABLE pepsi.workqueue_body SET (vacuum_truncate = false);

DROP TRIGGER workqueue_body_release ON pepsi.workqueue;

-- Only rows with a body fire it: a finished metadata-only message's delete
-- calls no function at all.
CREATE TRIGGER workqueue_body_release
    AFTER DELETE OR UPDATE OF body_id ON pepsi.workqueue
    FOR EACH ROW WHEN (OLD.body_id IS NOT NULL)
    EXECUTE FUNCTION pepsi.workqueue_body_release();

-- P-4: the oldest-first claim (FAIR_SCHEDULING = no): for every stage with
-- free capacity, up to that stage's capacity of its oldest pending rows. Each
-- lateral orders by (stage, workqueue_id) under an equality on stage, which is
-- exactly the partial index, so the planner walks it and stops at the cap
-- instead of scanning the primary key with a filter on a skewed backlog. The
-- picked ids are folded into an array so the update finds its rows by primary
-- key rather than joining the whole table. A function for its settings: with
-- the statistics a vacuum of the drained queue leaves (no tuples in its
-- pages), the planner took a bitmap of every pending row of the stage and
-- sorted it (107 ms a claim on a 200 000-row backlog).
CREATE FUNCTION pepsi.workqueue_claim_fifo(stages text[], caps integer[])
RETURNS TABLE (workqueue_id bigint, stage text)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
    UPDATE pepsi.workqueue w
    SET status = 'running'
    WHERE w.workqueue_id = ANY (ARRAY(
            SELECT c.workqueue_id
            FROM unnest(stages, caps) AS s(stage, cap)
            CROSS JOIN LATERAL (
                SELECT q.workqueue_id
                FROM pepsi.workqueue q
                WHERE q.stage = s.stage AND q.status = 'pending'
                ORDER BY q.stage, q.workqueue_id
                LIMIT s.cap
            ) c
          ))
      AND w.status = 'pending'
    RETURNING w.workqueue_id, w.stage
$$;
