-- 0022: the claims' and the dead-lettering's last step finds its rows by the primary key
-- whatever the statistics say (issue 33). Their UPDATE's guard was `w.status = 'pending'`,
-- which implies the partial indexes' predicate: after any VACUUM of an empty queue (the
-- operator's after a mass DELETE, or autovacuum's after a drain) the table and its
-- indexes are recorded with 0 rows (vacuum_truncate = false keeps the pages), and the
-- planner then read `workqueue_id = ANY(...)` through workqueue_pending_sender_idx,
-- whose third column it is: a pass over the whole index per claim (12 ms instead of
-- 0.5 with 2 000 senders), until the dispatcher's own VACUUM fixed the counts. `IS NOT
-- DISTINCT FROM` means the same on a NOT NULL column and implies no index predicate, so
-- only the primary key can serve the ids.

CREATE OR REPLACE FUNCTION pepsi.workqueue_dead_letter(
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
        -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
        WHERE w.workqueue_id = ANY(ids) AND w.status IS NOT DISTINCT FROM 'pending'
        RETURNING 1
    )
    SELECT count(*)::integer FROM moved
$$;

CREATE OR REPLACE FUNCTION pepsi.workqueue_claim_fifo(stages text[], caps integer[])
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
      -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
      AND w.status IS NOT DISTINCT FROM 'pending'
    RETURNING w.workqueue_id, w.stage
$$;

CREATE OR REPLACE FUNCTION pepsi.workqueue_claim_fair(
    stages text[], caps integer[], fifo integer[], averages double precision[],
    starts text[], lags jsonb, max_senders integer DEFAULT 64,
    OUT ids bigint[], OUT id_stages text[], OUT id_senders text[], OUT next_starts text[]
)
LANGUAGE plpgsql
-- Each sender's oldest rows must come from the sender index, one short
-- ordered probe per sender. On a small or freshly drained table the planner
-- would rather scan the heap once per sender (64 scans per claim); with
-- statistics from a moment the queue was empty it took a bitmap of every
-- pending row of the stage and sorted it, per sender: 50-600 ms a claim
-- under a burst (bench/race.py, fairness). No sequential scan, no bitmap
-- scan, and sorts only where no index gives the order.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
DECLARE
    i integer;
    picked bigint[] := '{}';
    senders text[];
    more text[];
    limits bigint[];
    chosen bigint[];
    attempt integer;
    stage_lags jsonb;
BEGIN
    next_starts := '{}';
    FOR i IN 1 .. coalesce(array_length(stages, 1), 0) LOOP
        -- When every pending row fits, the ranking would choose them all: take
        -- them without it (an idle pipeline's claim, the latency path).
        chosen := ARRAY(SELECT q.workqueue_id FROM pepsi.workqueue q
                        WHERE q.stage = stages[i] AND q.status = 'pending'
                        ORDER BY q.stage, q.workqueue_id
                        LIMIT caps[i] + 1);
        IF cardinality(chosen) <= caps[i] THEN
            picked := picked || chosen;
            next_starts := next_starts || starts[i];
            CONTINUE;
        END IF;
        stage_lags := coalesce(lags -> stages[i], '{}');
        senders := ARRAY(SELECT p.sender_key
                         FROM pepsi.workqueue_pending_senders(stages[i], starts[i], NULL,
                                                              max_senders) p);
        IF cardinality(senders) < max_senders AND starts[i] <> '' THEN
            more := ARRAY(SELECT p.sender_key
                          FROM pepsi.workqueue_pending_senders(
                              stages[i], '', starts[i], max_senders - cardinality(senders)) p);
            senders := senders || more;
        END IF;
        next_starts := next_starts || CASE WHEN cardinality(senders) >= max_senders
                                           THEN senders[cardinality(senders)] ELSE '' END;
        -- One sender waiting (one producer, the common case): its oldest rows are
        -- the stage's oldest, whatever its lag: the ranking would choose them.
        IF cardinality(senders) = 1 THEN
            picked := picked || chosen[1:caps[i]];
            CONTINUE;
        END IF;
        -- How many of each sender's oldest rows can matter, from the lags
        -- alone: the caps[i] smallest of the virtual scores lag + k × average
        -- (k ≤ caps[i]) lie under a threshold, and a sender's rows scoring
        -- above it cannot be chosen while every sender has that many rows.
        -- The threshold is bounded in closed form, without enumerating the
        -- virtual scores: filling senders level by level from the least
        -- lagged, the water level T is the least of (caps[i] × average + the
        -- m smallest lags) / m over m, and T + average bounds the exact
        -- threshold from above (a row or two more per sender is read, never
        -- fewer). When the first pass finds fewer rows than slots, the second
        -- reads up to caps[i] per sender, so the choice is always the full
        -- ranking's.
        limits := ARRAY(
            WITH lagged AS (
                SELECT s.n, coalesce((stage_lags ->> s.sender_key)::float8, 0) AS lag
                FROM unnest(senders) WITH ORDINALITY AS s(sender_key, n)
            ), filled AS (
                SELECT row_number() OVER w AS m, sum(g.lag) OVER w AS lag_sum
                FROM lagged g
                WINDOW w AS (ORDER BY g.lag ROWS UNBOUNDED PRECEDING)
            ), level AS (
                SELECT min((caps[i] * greatest(averages[i], 1e-9) + f.lag_sum) / f.m)
                       + greatest(averages[i], 1e-9) AS t
                FROM filled f
            )
            SELECT least(caps[i], greatest(0, floor(
                       (level.t - g.lag) / greatest(averages[i], 1e-9) + 1e-9)))::bigint
            FROM lagged g, level
            ORDER BY g.n);
        FOR attempt IN 1 .. 2 LOOP
            chosen := ARRAY(
                WITH oldest AS (
                    SELECT q.workqueue_id FROM pepsi.workqueue q
                    WHERE q.stage = stages[i] AND q.status = 'pending'
                    ORDER BY q.stage, q.workqueue_id
                    LIMIT least(fifo[i], caps[i])
                ), candidate AS (
                    SELECT c.workqueue_id,
                           coalesce((stage_lags ->> s.sender_key)::float8, 0) + c.k * averages[i]
                               AS score
                    FROM unnest(senders) WITH ORDINALITY AS s(sender_key, n)
                    CROSS JOIN LATERAL (
                        SELECT o.workqueue_id, row_number() OVER (ORDER BY o.workqueue_id) AS k
                        FROM (SELECT q.workqueue_id FROM pepsi.workqueue q
                              WHERE q.stage = stages[i] AND q.status = 'pending'
                                AND q.sender_key = s.sender_key
                              ORDER BY q.stage, q.sender_key, q.workqueue_id
                              LIMIT CASE WHEN attempt = 1 THEN limits[s.n] ELSE caps[i] END) o
                    ) c
                )
                SELECT o.workqueue_id FROM oldest o
                UNION ALL
                (SELECT c.workqueue_id FROM candidate c
                 WHERE c.workqueue_id NOT IN (SELECT o.workqueue_id FROM oldest o)
                 ORDER BY c.score, c.workqueue_id
                 LIMIT caps[i] - (SELECT count(*) FROM oldest))
            );
            EXIT WHEN cardinality(chosen) >= caps[i];
        END LOOP;
        picked := picked || chosen;
    END LOOP;
    WITH claimed AS (
        UPDATE pepsi.workqueue w SET status = 'running'
        -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
        WHERE w.workqueue_id = ANY(picked) AND w.status IS NOT DISTINCT FROM 'pending'
        RETURNING w.workqueue_id, w.stage, w.sender_key
    )
    SELECT coalesce(array_agg(c.workqueue_id ORDER BY c.workqueue_id), '{}'),
           coalesce(array_agg(c.stage ORDER BY c.workqueue_id), '{}'),
           coalesce(array_agg(c.sender_key ORDER BY c.workqueue_id), '{}')
    INTO ids, id_stages, id_senders
    FROM claimed c;
END
$$;
