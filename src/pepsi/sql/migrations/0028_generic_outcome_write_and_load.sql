-- 0028: a stage that reads the message's content writes each outcome as soon as it
-- is known (a relay's, a signature's) and loads its small batches with their bodies.
-- Both statements were sent as client statements that psycopg prepares, and
-- PostgreSQL planned them afresh for every call (a custom plan looked cheaper than
-- a generic one costed for ten ids): 0.2-0.4 ms of the server's CPU for a relay's
-- finished message, against 0.07 ms now (bench/mail.py: the workers' sessions took
-- more of PostgreSQL's CPU than the ingress's and the dispatcher's together). Each
-- is now a function whose only plan is the primary key probe (sequential and bitmap
-- scans off), kept as one generic plan, as the claim and the metadata load are (0026).

-- A batch's outcomes (W-2, W-8): finished rows are deleted, the others updated from
-- a JSON array (advance = pending at the next stage, pause = paused with a timeout,
-- fail = failed). The guard on status and stage makes a late write from a killed
-- worker a no-op. The rows to update are also named as an array of ids, so the table
-- side is always primary-key probes (joined to the recordset alone, statistics from
-- a drained table made it a scan of the whole table per batch). One statement for
-- the caller: both writes or neither.
CREATE FUNCTION pepsi.workqueue_record_outcomes(at_stage text, finished bigint[], updates jsonb)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    IF cardinality(finished) > 0 THEN
        DELETE FROM pepsi.workqueue w
        WHERE w.workqueue_id = ANY(finished) AND w.status = 'running' AND w.stage = at_stage;
    END IF;
    IF jsonb_array_length(updates) > 0 THEN
        UPDATE pepsi.workqueue w
        SET stage = r.stage, status = r.status, timeout = r.timeout, state = r.state
        FROM jsonb_to_recordset(updates)
             AS r(workqueue_id bigint, stage text, status pepsi.workqueue_status,
                  timeout timestamptz, state jsonb)
        WHERE w.workqueue_id = ANY(ARRAY(SELECT (e ->> 'workqueue_id')::bigint
                                         FROM jsonb_array_elements(updates) e))
          AND w.workqueue_id = r.workqueue_id AND w.status = 'running'
          AND w.stage = at_stage;
    END IF;
END
$$;

-- A worker's load of the rows it was handed, with their header blocks and bodies
-- when the stage reads them (W-2): only rows still running at its stage (a repair
-- command may have moved one meanwhile). Header and body come with the row when
-- they are at most `inline` bytes each; a larger one is fetched on its own when the
-- stage reads it (`deferred`). One primary-key probe of the bodies per row (none
-- when neither is wanted), by a lateral subquery whose LIMIT keeps it from being
-- flattened into a join: with statistics from a moment the tables were empty, a
-- join walked the whole body index once per row.
CREATE FUNCTION pepsi.workqueue_load_running(
    ids bigint[], at_stage text, with_header boolean, with_body boolean, inline integer
)
RETURNS TABLE (
    workqueue_id bigint, stage text, arrived timestamptz, message_id text, sender text,
    recipients text[], origin_user text, origin_peer text, header_from text, subject text,
    content_type text, correlation_id text, properties jsonb, state jsonb,
    sender_key text, body_id bigint, header bytea, body bytea, deferred boolean, token text
)
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT w.workqueue_id, w.stage, w.arrived, w.message_id, w.sender, w.recipients,
           w.origin_user, host(w.origin_peer), w.header_from, w.subject, w.content_type,
           w.correlation_id, w.properties, w.state, w.sender_key, w.body_id,
           CASE WHEN octet_length(b.header) <= inline THEN b.header END,
           CASE WHEN with_body AND octet_length(b.body) <= inline THEN b.body END,
           coalesce(octet_length(b.header) > inline
                    OR (with_body AND octet_length(b.body) > inline), false),
           w.xmin::text  -- the claim token (issue 18)
    FROM pepsi.workqueue w
    LEFT JOIN LATERAL (
        SELECT x.header, x.body FROM pepsi.workqueue_body x
        WHERE x.body_id = w.body_id AND with_header
        LIMIT 1
    ) b ON true
    WHERE w.workqueue_id = ANY(ids) AND w.status = 'running' AND w.stage = at_stage
$$;

-- The bodies' release after a DELETE (D-2) keeps one generic plan of each of its
-- statements too: planned per call, it cost a finished message about 0.01 ms more.
ALTER FUNCTION pepsi.workqueue_body_release_deleted() SET plan_cache_mode = force_generic_plan;
