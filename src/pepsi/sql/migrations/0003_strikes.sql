-- 0003: failure handling (W-6, R-8, R-9): strikes, and the failure bouncer's sink.

-- The n-th strike pauses the row for delays[n] seconds; the third (the
-- delivery limit, R-8) ends it: failed after a crash, timeout after a hang,
-- with state.failure_class crashed or timed-out. Returns the new strike
-- count, or 0 when the row is no longer running at that stage.
CREATE FUNCTION pepsi.workqueue_strike(
    id bigint, at_stage text, kind text, reason text, delays double precision[],
    max_strikes integer DEFAULT 3
) RETURNS integer
LANGUAGE sql AS $$
    WITH cur AS (
        SELECT w.workqueue_id, coalesce((w.state->>'strikes')::integer, 0) + 1 AS n
        FROM pepsi.workqueue w
        WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = at_stage
        FOR UPDATE
    ), struck AS (
        UPDATE pepsi.workqueue w
        SET status = CASE
                WHEN cur.n < max_strikes THEN 'paused'
                WHEN kind = 'timed-out' THEN 'timeout'
                ELSE 'failed' END::pepsi.workqueue_status,
            timeout = CASE WHEN cur.n < max_strikes
                THEN now() + make_interval(secs => coalesce(delays[cur.n], delays[1])) END,
            state = w.state
                || jsonb_build_object('strikes', cur.n, 'last_error', reason)
                || CASE WHEN cur.n < max_strikes THEN '{}'::jsonb
                   ELSE jsonb_build_object('failed_stage', at_stage, 'failure_class', kind) END
        FROM cur
        WHERE w.workqueue_id = cur.workqueue_id
        RETURNING cur.n
    )
    SELECT coalesce((SELECT n FROM struck), 0)
$$;

-- pepsi-failure-bouncer: failed and timed-out messages of stages without a
-- BOUNCE_STAGE go to a dead-letter sink. The table sink keeps the whole
-- message (envelope, state, header block and body) for an operator.
CREATE TABLE pepsi.dead_letter (
    workqueue_id   bigint PRIMARY KEY,
    stage          text NOT NULL,
    status         pepsi.workqueue_status NOT NULL,
    arrived        timestamptz NOT NULL,
    dead_lettered  timestamptz NOT NULL DEFAULT now(),
    message_id     text,
    sender         text,
    recipients     text[] NOT NULL,
    origin_user    text,
    origin_peer    inet,
    header_from    text,
    subject        text,
    content_type   text,
    correlation_id text,
    properties     jsonb NOT NULL,
    state          jsonb NOT NULL,
    header         bytea,
    body           bytea
);

CREATE INDEX workqueue_failed_idx ON pepsi.workqueue (stage, workqueue_id)
    WHERE status IN ('failed', 'timeout');

-- Move up to max_rows failed/timeout rows of `stages` to the sink: a stage
-- (pending there, state.bounced_from set) or, when sink_stage is NULL, the
-- table pepsi.dead_letter (the rows leave the queue). Returns how many moved.
CREATE FUNCTION pepsi.workqueue_bounce_failed(
    stages text[], sink_stage text, max_rows integer DEFAULT 1000
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    moved integer;
BEGIN
    IF sink_stage IS NOT NULL THEN
        WITH picked AS (
            SELECT w.workqueue_id FROM pepsi.workqueue w
            WHERE w.status IN ('failed', 'timeout') AND w.stage = ANY(stages)
            ORDER BY w.workqueue_id LIMIT max_rows FOR UPDATE
        ), done AS (
            UPDATE pepsi.workqueue w
            SET stage = sink_stage, status = 'pending', timeout = NULL,
                state = w.state || jsonb_build_object('bounced_from', w.stage,
                                                      'bounced_status', w.status::text)
            FROM picked WHERE w.workqueue_id = picked.workqueue_id
            RETURNING 1
        )
        SELECT count(*) INTO moved FROM done;
        IF moved > 0 THEN
            PERFORM pg_notify('workqueue', '');
        END IF;
        RETURN moved;
    END IF;
    WITH gone AS (
        DELETE FROM pepsi.workqueue w
        WHERE w.workqueue_id IN (
            SELECT q.workqueue_id FROM pepsi.workqueue q
            WHERE q.status IN ('failed', 'timeout') AND q.stage = ANY(stages)
            ORDER BY q.workqueue_id LIMIT max_rows FOR UPDATE)
        RETURNING w.*
    ), kept AS (
        INSERT INTO pepsi.dead_letter
            (workqueue_id, stage, status, arrived, message_id, sender, recipients, origin_user,
             origin_peer, header_from, subject, content_type, correlation_id, properties,
             state, header, body)
        SELECT g.workqueue_id, g.stage, g.status, g.arrived, g.message_id, g.sender,
               g.recipients, g.origin_user, g.origin_peer, g.header_from, g.subject,
               g.content_type, g.correlation_id, g.properties, g.state, b.header, b.body
        FROM gone g LEFT JOIN pepsi.workqueue_body b ON b.body_id = g.body_id
        RETURNING 1
    )
    SELECT count(*) INTO moved FROM kept;
    RETURN moved;
END
$$;
