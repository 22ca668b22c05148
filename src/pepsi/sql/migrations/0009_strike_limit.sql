-- 0009: the strike limit (R-8's delivery limit) loses its default here: the
-- dispatcher passes it with every strike (MAX_STRIKES in dispatch/rows.py),
-- so it has one source. A default cannot be dropped in place.

DROP FUNCTION pepsi.workqueue_strike(bigint, text, text, text, double precision[], integer);

CREATE FUNCTION pepsi.workqueue_strike(
    id bigint, at_stage text, kind text, reason text, delays double precision[],
    max_strikes integer
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
