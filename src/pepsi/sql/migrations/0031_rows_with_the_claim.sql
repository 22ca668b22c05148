-- 0031: a small claim hands a metadata-only stage's workers their rows with the ids
-- (issue 36): the worker's load, one statement of three on an idle message's way
-- after the publish, is skipped.
-- The rows a small claim just took, for the workers that take them with their ids
-- (docs/protocol.md, "Rows with the ids"): each as workqueue_load_metadata reads it
-- for its stage (the same columns and conditions, written out: calling that function
-- per stage cost an idle claim 0.1 ms more warm, 0.2 cold), as one JSON array of its
-- columns after the id (the token last), in the order of `ids`; NULL for a row of a
-- stage not in `for_stages`, or no longer running. The claim statement calls it
-- after the claim function: VOLATILE, so that its query takes a snapshot of its own
-- and sees the rows as the claim left them (running, their token the claim's). An
-- idle metadata-only stage so skips its load, one statement of three on a message's
-- way after the publish (0.5 of 2.1 ms on a 2-core VM, where each statement woken
-- after an idle spell costs 0.3-0.4 ms).
CREATE FUNCTION pepsi.workqueue_claimed_rows(ids bigint[], for_stages text[])
RETURNS text[]
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT ARRAY(
        SELECT (SELECT json_build_array(
                           w.stage, w.arrived, w.message_id, w.sender, w.recipients,
                           w.origin_user, host(w.origin_peer), w.header_from, w.subject,
                           w.content_type, w.correlation_id, w.properties, w.state,
                           w.sender_key, w.body_id, w.xmin::text)::text
                FROM pepsi.workqueue w
                WHERE w.workqueue_id = u.id AND w.status = 'running'
                  AND w.stage = ANY(for_stages))
        FROM unnest(ids) WITH ORDINALITY AS u(id, n)
        ORDER BY u.n)
$$;
