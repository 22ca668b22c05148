-- 0008: the queue tables under load. Vacuum never truncates them: a vacuum
-- that found the end of a drained queue empty truncated it (an exclusive lock
-- retried for up to 5 s, and a table of no pages for the planner), and the
-- next burst's fair claims took 50-190 ms each. The body-release trigger
-- fires only for rows that have a body: a metadata-only message's delete no
-- longer calls a plpgsql function (15 % of a batched delete's cost per row).

ALTER TABLE pepsi.workqueue SET (vacuum_truncate = false);
ALTER TABLE pepsi.workqueue_body SET (vacuum_truncate = false);

DROP TRIGGER workqueue_body_release ON pepsi.workqueue;

-- Only rows with a body fire it: a finished metadata-only message's delete
-- calls no function at all.
CREATE TRIGGER workqueue_body_release
    AFTER DELETE OR UPDATE OF body_id ON pepsi.workqueue
    FOR EACH ROW WHEN (OLD.body_id IS NOT NULL)
    EXECUTE FUNCTION pepsi.workqueue_body_release();
