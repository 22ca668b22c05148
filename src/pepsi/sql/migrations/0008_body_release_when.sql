-- 0008: the body-release trigger fires only for rows that have a body; a
-- metadata-only message's delete no longer calls a plpgsql function (15 % of
-- a batched delete's cost per row).

DROP TRIGGER workqueue_body_release ON pepsi.workqueue;

-- Only rows with a body fire it: a finished metadata-only message's delete
-- calls no function at all.
CREATE TRIGGER workqueue_body_release
    AFTER DELETE OR UPDATE OF body_id ON pepsi.workqueue
    FOR EACH ROW WHEN (OLD.body_id IS NOT NULL)
    EXECUTE FUNCTION pepsi.workqueue_body_release();
