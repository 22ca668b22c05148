-- 0026: an idle message reaches its stage sooner (issue 36): two statements on its
-- way, the fair claim's UPDATE and a metadata-only stage's load, were planned afresh
-- for every call, about 0.1 ms each. Each is now a function whose only plan is the
-- primary key probe (sequential and bitmap scans off), kept as one generic plan.

-- The last step of the fair claim: the picked ids, still pending, now running.
-- A function of its own for one setting (0026): under the claim's
-- enable_bitmapscan = off, a generic plan of this UPDATE, costed for ten ids,
-- looked dearer than a custom one for one id, so an idle claim planned it
-- afresh every time (a third of its time in the database). Its only plan is the
-- primary key probe whatever the statistics (seqscan and bitmap scans off, and
-- IS NOT DISTINCT FROM, see 0022), so one generic plan serves every claim.
CREATE FUNCTION pepsi.workqueue_claim_ids(picked bigint[])
RETURNS TABLE (workqueue_id bigint, stage text, sender_key text, priority smallint)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    UPDATE pepsi.workqueue w SET status = 'running'
    -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
    WHERE w.workqueue_id = ANY(picked) AND w.status IS NOT DISTINCT FROM 'pending'
    RETURNING w.workqueue_id, w.stage, w.sender_key, w.priority
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
    prioritised boolean;
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
        -- Rows with a priority (x-max-priority, priority=): one probe of their index,
        -- empty without any. With some, each sender's rows go highest first.
        prioritised := EXISTS (SELECT 1 FROM pepsi.workqueue q
                               WHERE q.stage = stages[i] AND q.status = 'pending'
                                 AND q.priority > 0);
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
        IF cardinality(senders) = 1 AND NOT prioritised THEN
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
            EXIT WHEN prioritised;
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
        -- The same with rows that have a priority: the head and each sender's rows
        -- taken highest first. A copy, so that the common case keeps its plans.
        FOR attempt IN 1 .. 2 LOOP
            EXIT WHEN NOT prioritised;
            chosen := ARRAY(
                WITH oldest AS (  -- the stage's head: highest priority, then oldest
                    SELECT h.workqueue_id
                    FROM ((SELECT q.workqueue_id, q.priority FROM pepsi.workqueue q
                           WHERE q.stage = stages[i] AND q.status = 'pending'
                             AND q.priority > 0
                           ORDER BY q.stage, q.priority DESC, q.workqueue_id
                           LIMIT least(fifo[i], caps[i]))
                          UNION
                          (SELECT q.workqueue_id, q.priority FROM pepsi.workqueue q
                           WHERE q.stage = stages[i] AND q.status = 'pending'
                           ORDER BY q.stage, q.workqueue_id
                           LIMIT least(fifo[i], caps[i]))) h
                    ORDER BY h.priority DESC, h.workqueue_id
                    LIMIT least(fifo[i], caps[i])
                ), candidate AS (
                    SELECT c.workqueue_id,
                           coalesce((stage_lags ->> s.sender_key)::float8, 0) + c.k * averages[i]
                               AS score
                    FROM unnest(senders) WITH ORDINALITY AS s(sender_key, n)
                    CROSS JOIN LATERAL (
                        -- the sender's rows highest priority first: those with one from
                        -- their index, then its oldest (with their priority, from the row)
                        SELECT o.workqueue_id,
                               row_number() OVER (ORDER BY o.priority DESC, o.workqueue_id) AS k
                        FROM ((SELECT q.workqueue_id, q.priority FROM pepsi.workqueue q
                               WHERE q.stage = stages[i] AND q.status = 'pending'
                                 AND q.sender_key = s.sender_key AND q.priority > 0
                               ORDER BY q.stage, q.sender_key, q.priority DESC, q.workqueue_id
                               LIMIT CASE WHEN attempt = 1 THEN limits[s.n] ELSE caps[i] END)
                              UNION
                              (SELECT q.workqueue_id, q.priority FROM pepsi.workqueue q
                               WHERE q.stage = stages[i] AND q.status = 'pending'
                                 AND q.sender_key = s.sender_key
                               ORDER BY q.stage, q.sender_key, q.workqueue_id
                               LIMIT CASE WHEN attempt = 1 THEN limits[s.n] ELSE caps[i] END)) o
                        ORDER BY o.priority DESC, o.workqueue_id
                        LIMIT CASE WHEN attempt = 1 THEN limits[s.n] ELSE caps[i] END
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
    WITH claimed AS (  -- one generic plan, not one planned per call (0026)
        SELECT * FROM pepsi.workqueue_claim_ids(picked)
    )  -- in the order they are to be served: highest priority first, then oldest
    SELECT coalesce(array_agg(c.workqueue_id ORDER BY c.priority DESC, c.workqueue_id), '{}'),
           coalesce(array_agg(c.stage ORDER BY c.priority DESC, c.workqueue_id), '{}'),
           coalesce(array_agg(c.sender_key ORDER BY c.priority DESC, c.workqueue_id), '{}')
    INTO ids, id_stages, id_senders
    FROM claimed c;
END
$$;

-- A metadata-only stage's load (0026): the rows among `ids` still running at
-- `at_stage`, their columns and claim token, without the header block and
-- body (loaded on first access). The plain load (workqueue_load_running in
-- queries.sql) is a custom plan per batch, as psycopg prepares it: its plan,
-- the lateral join included, cost an idle worker about 0.1 ms a message. This
-- one is a primary key probe whatever the statistics (sequential and bitmap
-- scans off), so one generic plan serves every batch.
CREATE FUNCTION pepsi.workqueue_load_metadata(ids bigint[], at_stage text)
RETURNS TABLE (
    workqueue_id bigint, stage text, arrived timestamptz, message_id text, sender text,
    recipients text[], origin_user text, origin_peer text, header_from text, subject text,
    content_type text, correlation_id text, properties jsonb, state jsonb,
    sender_key text, body_id bigint, token text
)
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT w.workqueue_id, w.stage, w.arrived, w.message_id, w.sender, w.recipients,
           w.origin_user, host(w.origin_peer), w.header_from, w.subject, w.content_type,
           w.correlation_id, w.properties, w.state, w.sender_key, w.body_id,
           w.xmin::text  -- the claim token (issue 18)
    FROM pepsi.workqueue w
    WHERE w.workqueue_id = ANY(ids) AND w.status = 'running' AND w.stage = at_stage
$$;

