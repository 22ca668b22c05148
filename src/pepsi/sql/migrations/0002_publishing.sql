-- 0002: publishing (R-3, R-6, R-10): deduplication window, per-message
-- expiry index, and the server-side sweeps the dispatcher runs.

-- Idempotent publish: a message id seen within the window maps to the id of
-- the message first published under it, even after that row is gone.
CREATE TABLE pepsi.publish_dedup (
    message_id   text PRIMARY KEY,
    workqueue_id bigint NOT NULL,
    published    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX publish_dedup_published_idx ON pepsi.publish_dedup (published);

-- Per-message expiry: only rows that carry one are in this index.
CREATE INDEX workqueue_expires_idx ON pepsi.workqueue (expires)
    WHERE status = 'pending' AND expires IS NOT NULL;

-- Dead-letter one expired or overflowing row set (R-9, R-10, R-3): to the
-- stage's bounce stage as pending, or failed when it has none. One UPDATE,
-- so a message is never both dead-lettered and left behind.
CREATE FUNCTION pepsi.workqueue_dead_letter(
    ids bigint[], bounce text, reason text
) RETURNS integer
LANGUAGE sql AS $$
    WITH moved AS (
        UPDATE pepsi.workqueue w
        SET stage = coalesce(bounce, w.stage),
            status = CASE WHEN bounce IS NULL THEN 'failed' ELSE 'pending' END
                     ::pepsi.workqueue_status,
            expires = NULL,
            timeout = NULL,
            state = w.state || jsonb_build_object(
                'last_error', 'dead-lettered: ' || reason,
                'failed_stage', w.stage,
                'failure_class', reason,
                'dead_letter_reason', reason)
        WHERE w.workqueue_id = ANY(ids) AND w.status = 'pending'
        RETURNING 1
    )
    SELECT count(*)::integer FROM moved
$$;

-- R-10: the dispatcher's expiry sweep. For each stage with a TTL, its oldest
-- pending rows that arrived longer ago than the TTL; then rows whose own
-- expiry has passed. At most max_rows per stage per call.
CREATE FUNCTION pepsi.workqueue_expire(
    stages text[], ttls double precision[], bounces text[], max_rows integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    total integer := 0;
    i integer;
    ids bigint[];
    bounce text;
BEGIN
    FOR i IN 1 .. coalesce(array_length(stages, 1), 0) LOOP
        IF ttls[i] IS NOT NULL THEN
            -- Only the head of the stage's pending index: ids grow with
            -- arrival, so the oldest rows are there, and the cost stays
            -- bounded whatever the backlog (a row that arrived out of order
            -- is caught when it reaches the head).
            SELECT array_agg(s.workqueue_id) INTO ids FROM (
                SELECT q.workqueue_id, q.arrived FROM pepsi.workqueue q
                WHERE q.stage = stages[i] AND q.status = 'pending'
                ORDER BY q.stage, q.workqueue_id
                LIMIT max_rows) s
            WHERE s.arrived < now() - make_interval(secs => ttls[i]);
            IF ids IS NOT NULL THEN
                total := total + pepsi.workqueue_dead_letter(ids, bounces[i], 'expired');
            END IF;
        END IF;
    END LOOP;
    FOR i IN 1 .. coalesce(array_length(stages, 1), 0) LOOP
        SELECT array_agg(workqueue_id) INTO ids FROM (
            SELECT q.workqueue_id FROM pepsi.workqueue q
            WHERE q.status = 'pending' AND q.expires IS NOT NULL AND q.expires <= now()
              AND q.stage = stages[i]
            ORDER BY q.expires
            LIMIT max_rows) s;
        IF ids IS NOT NULL THEN
            total := total + pepsi.workqueue_dead_letter(ids, bounces[i], 'expired');
        END IF;
    END LOOP;
    RETURN total;
END
$$;

-- Sweep the deduplication window: at most max_rows per call.
CREATE FUNCTION pepsi.publish_dedup_sweep(window_seconds double precision,
                                          max_rows integer DEFAULT 10000)
RETURNS integer
LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM pepsi.publish_dedup d
        WHERE d.message_id IN (
            SELECT message_id FROM pepsi.publish_dedup
            WHERE published < now() - make_interval(secs => window_seconds)
            ORDER BY published
            LIMIT max_rows)
        RETURNING 1
    )
    SELECT count(*)::integer FROM gone
$$;

-- R-1, R-3, R-6: publish a batch in one round trip. Rows come as a JSON
-- array (one object per message, "ord" numbering them from 1), header blocks
-- and bodies as arrays indexed by ord. Returns, per message, its id and
-- whether it was inserted (false: a duplicate within the dedup window, whose
-- original id is returned). Length-limited stages of the batch are locked
-- first, so publishes never overshoot MAX_LENGTH; the check runs after the
-- insert and either rejects the whole batch (SQLSTATE PP001) or dead-letters
-- the oldest pending rows (drop-head). One NOTIFY for the batch; the commit
-- is synchronous whatever the session's default.
CREATE FUNCTION pepsi.workqueue_publish(
    rows jsonb,
    headers bytea[],
    bodies bytea[],
    limits jsonb DEFAULT '[]',
    dedup_window double precision DEFAULT 86400
) RETURNS TABLE (out_ord integer, out_id bigint, out_inserted boolean)
LANGUAGE plpgsql AS $$
DECLARE
    lim record;
    lo bigint;
    hi bigint;
    pending bigint;
    victims bigint[];
BEGIN
    PERFORM set_config('synchronous_commit', 'on', true);
    FOR lim IN
        SELECT l.stage FROM jsonb_to_recordset(limits) AS l(stage text) ORDER BY l.stage
    LOOP
        PERFORM pg_advisory_xact_lock(1885696116, hashtext(lim.stage));
    END LOOP;

    RETURN QUERY
    WITH input AS (
        SELECT s.*, nextval('pepsi.workqueue_workqueue_id_seq') AS new_id,
               CASE WHEN s.has_body
                    THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM (
            SELECT r.*, headers[r.ord] AS header, bodies[r.ord] AS body
            FROM jsonb_to_recordset(rows) AS r(
                ord integer, stage text, message_id text, dedup boolean, sender text,
                recipients text[], origin_user text, origin_peer inet, header_from text,
                subject text, content_type text, correlation_id text, properties jsonb,
                expires timestamptz, has_body boolean)
            ORDER BY r.ord
        ) s
        ORDER BY s.ord
    ), dedup AS (
        INSERT INTO pepsi.publish_dedup AS d (message_id, workqueue_id, published)
        SELECT i.message_id, i.new_id, now() FROM input i WHERE i.dedup
        ON CONFLICT (message_id) DO UPDATE
        SET workqueue_id = CASE
                WHEN d.published < now() - make_interval(secs => dedup_window)
                THEN EXCLUDED.workqueue_id ELSE d.workqueue_id END,
            published = CASE
                WHEN d.published < now() - make_interval(secs => dedup_window)
                THEN EXCLUDED.published ELSE d.published END
        RETURNING d.message_id, d.workqueue_id
    ), fresh AS (
        SELECT i.*
        FROM input i LEFT JOIN dedup x ON i.dedup AND x.message_id = i.message_id
        WHERE NOT i.dedup OR x.workqueue_id = i.new_id
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT f.new_body_id, f.header, f.body FROM fresh f WHERE f.has_body
    ), stored_rows AS (
        INSERT INTO pepsi.workqueue
            (workqueue_id, stage, message_id, sender, recipients, origin_user, origin_peer,
             header_from, subject, content_type, correlation_id, properties, expires, body_id)
        SELECT f.new_id, f.stage, f.message_id, f.sender, coalesce(f.recipients, '{}'),
               f.origin_user, f.origin_peer, f.header_from, f.subject, f.content_type,
               f.correlation_id, coalesce(f.properties, '{}'), f.expires, f.new_body_id
        FROM fresh f
        ORDER BY f.ord
    )
    SELECT i.ord, coalesce(x.workqueue_id, i.new_id), (NOT i.dedup OR x.workqueue_id = i.new_id)
    FROM input i LEFT JOIN dedup x ON i.dedup AND x.message_id = i.message_id
    ORDER BY i.ord;

    FOR lim IN
        SELECT * FROM jsonb_to_recordset(limits)
            AS l(stage text, max_length bigint, drop_head boolean, bounce text)
    LOOP
        -- Two index probes bound the count: well under the limit, no counting.
        SELECT min(w.workqueue_id), max(w.workqueue_id) INTO lo, hi
        FROM pepsi.workqueue w WHERE w.stage = lim.stage AND w.status = 'pending';
        CONTINUE WHEN lo IS NULL OR hi - lo + 1 <= lim.max_length;
        SELECT count(*) INTO pending FROM (
            SELECT 1 FROM pepsi.workqueue w
            WHERE w.stage = lim.stage AND w.status = 'pending'
            ORDER BY w.stage, w.workqueue_id
            LIMIT lim.max_length + jsonb_array_length(rows)) s;
        CONTINUE WHEN pending <= lim.max_length;
        IF NOT lim.drop_head THEN
            RAISE EXCEPTION 'stage % is full (MAX_LENGTH %)', lim.stage, lim.max_length
                USING ERRCODE = 'PP001', DETAIL = lim.stage;
        END IF;
        SELECT array_agg(v.workqueue_id) INTO victims FROM (
            SELECT w.workqueue_id FROM pepsi.workqueue w
            WHERE w.stage = lim.stage AND w.status = 'pending'
            ORDER BY w.stage, w.workqueue_id
            LIMIT pending - lim.max_length) v;
        PERFORM pepsi.workqueue_dead_letter(victims, lim.bounce, 'overflow');
    END LOOP;

    PERFORM pg_notify('workqueue', '');
END
$$;
