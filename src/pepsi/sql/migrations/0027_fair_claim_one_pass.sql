-- 0027: the fair claim reads each sender of its window with its oldest rows in one
-- index descent (pepsi.workqueue_pending_sender_rows) and ranks them in the same
-- statement; a second read, of the few senders whose further rows may still rank in,
-- only when the rows read do not settle the ranking. The same choice as before.

-- The same window with each sender's oldest `per_sender` pending rows, read by the
-- same descent that finds the sender (its rows follow its key in the index): one
-- probe per sender for both. A step reads `per_sender` entries from the next key on,
-- of which it keeps the first sender's. The status is checked again on the row
-- (always true) so that the rows are read by an index scan, not an index-only one:
-- that one copies every entry of the leaf page it lands on for the few it returns,
-- and a queue's pages are seldom all-visible, so each row it returns is read from
-- the heap anyway (10-40 % less time a claim with 100 senders).
CREATE FUNCTION pepsi.workqueue_pending_sender_rows(
    at_stage text, after_key text, upto_key text, max_senders integer, per_sender integer
) RETURNS TABLE (sender_key text, ids bigint[])
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE s(k, ids) AS (
        (SELECT r.sender_key, array_agg(r.workqueue_id ORDER BY r.workqueue_id)
         FROM (SELECT q.sender_key, q.workqueue_id FROM pepsi.workqueue q
               WHERE q.stage = at_stage AND q.status = 'pending' AND q.sender_key > after_key
                 AND q.status IS NOT DISTINCT FROM 'pending'  -- (read from the heap: below)
               ORDER BY q.stage, q.sender_key, q.workqueue_id
               LIMIT per_sender) r
         GROUP BY r.sender_key
         ORDER BY r.sender_key
         LIMIT 1)
        UNION ALL
        SELECT n.k, n.ids
        FROM s CROSS JOIN LATERAL (
            SELECT r.sender_key AS k, array_agg(r.workqueue_id ORDER BY r.workqueue_id) AS ids
            FROM (SELECT q.sender_key, q.workqueue_id FROM pepsi.workqueue q
                  WHERE q.stage = at_stage AND q.status = 'pending' AND q.sender_key > s.k
                    AND q.status IS NOT DISTINCT FROM 'pending'
                  ORDER BY q.stage, q.sender_key, q.workqueue_id
                  LIMIT per_sender) r
            GROUP BY r.sender_key
            ORDER BY r.sender_key
            LIMIT 1
        ) n
        WHERE upto_key IS NULL OR s.k < upto_key
    )
    SELECT k, ids FROM s
    WHERE upto_key IS NULL OR k <= upto_key
    LIMIT max_senders
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
    head bigint[];        -- the share taken whatever the sender
    slots integer;        -- what the ranking fills
    average float8;       -- the stage's, kept above 0 to divide by
    per_sender integer;   -- rows read with each sender in the first pass
    sender_lags float8[];
    counts integer[];     -- rows read of each sender
    wanted integer[];     -- rows asked of each (fewer read: it has no more)
    lasts bigint[];       -- the last row read of each
    ranked bigint[];      -- the best rows read, best first
    scores float8[];      -- their scores
    unread float8;        -- the least score of a row not read
    target float8;
    others boolean;       -- another sender than the oldest row's has rows waiting
BEGIN
    next_starts := '{}';
    FOR i IN 1 .. coalesce(array_length(stages, 1), 0) LOOP
        IF caps[i] <= 0 THEN  -- no room: nothing to rank
            next_starts := next_starts || starts[i];
            CONTINUE;
        END IF;
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
        average := greatest(averages[i], 1e-9);
        IF NOT prioritised THEN
            -- One sender waiting (one producer, the common case): its oldest rows are
            -- the stage's oldest, whatever its lag: the ranking would choose them. The
            -- sender of the oldest row, and one probe each way for another.
            SELECT EXISTS (SELECT 1 FROM pepsi.workqueue q
                           WHERE q.stage = stages[i] AND q.status = 'pending'
                             AND q.sender_key > o.sender_key)
                   OR EXISTS (SELECT 1 FROM pepsi.workqueue q
                              WHERE q.stage = stages[i] AND q.status = 'pending'
                                AND q.sender_key < o.sender_key)
            INTO others
            FROM pepsi.workqueue o WHERE o.workqueue_id = chosen[1];
            IF others IS FALSE THEN
                picked := picked || chosen[1:caps[i]];
                next_starts := next_starts || ''::text;
                CONTINUE;
            END IF;
            head := chosen[1:least(fifo[i], caps[i])];
            slots := caps[i] - cardinality(head);
            -- One pass: the window's senders, each with its oldest rows (one index
            -- descent per sender for both), ranked. A few rows more than an even
            -- share of the claim between the senders the window may hold (as many as
            -- the dispatcher sent lags of, up to max_senders): the least served of
            -- lags a few messages apart take a few more. When the window has too few
            -- senders for that to fill the claim, again with an even share of theirs.
            per_sender := (SELECT count(*) FROM (SELECT jsonb_object_keys(stage_lags)
                                                 LIMIT max_senders) k);
            per_sender := least(caps[i], ceil(caps[i]::float8 / CASE WHEN per_sender > 0
                                THEN per_sender ELSE max_senders END)::integer + 3);
            LOOP
                WITH w AS MATERIALIZED (
                    SELECT p.sender_key, p.ids,
                           coalesce((stage_lags ->> p.sender_key)::float8, 0) AS lag
                    FROM ((SELECT * FROM pepsi.workqueue_pending_sender_rows(
                               stages[i], starts[i], NULL, max_senders, per_sender))
                          UNION ALL  -- the window wraps around, up to where it started
                          (SELECT * FROM pepsi.workqueue_pending_sender_rows(
                               stages[i], '', starts[i], max_senders, per_sender)
                           WHERE starts[i] <> '')
                          LIMIT max_senders) p
                ), r AS (
                    SELECT v.id, v.score
                    FROM (SELECT unnest(w.ids) AS id,
                                 w.lag + generate_series(1, cardinality(w.ids)) * averages[i]
                                     AS score
                          FROM w) v
                    WHERE v.id <> ALL(head)
                    ORDER BY v.score, v.id
                    LIMIT slots
                )
                SELECT a.*, b.*
                FROM (SELECT array_agg(w.sender_key), array_agg(w.lag),
                             array_agg(cardinality(w.ids)), array_agg(w.ids[cardinality(w.ids)]),
                             -- a sender read to per_sender rows may have more: its next one
                             min(w.lag + (per_sender + 1) * averages[i])
                                 FILTER (WHERE cardinality(w.ids) = per_sender
                                           AND per_sender < caps[i])
                      FROM w) a,
                     (SELECT array_agg(r.id ORDER BY r.score, r.id),
                             array_agg(r.score ORDER BY r.score, r.id)
                      FROM r) b
                INTO senders, sender_lags, counts, lasts, unread, ranked, scores;
                EXIT WHEN cardinality(senders) * per_sender >= caps[i] OR per_sender >= caps[i]
                          OR unread IS NULL;
                per_sender := least(caps[i],
                                    ceil(caps[i]::float8 / cardinality(senders))::integer + 3);
            END LOOP;
            next_starts := next_starts || CASE WHEN cardinality(senders) >= max_senders
                                               THEN senders[cardinality(senders)] ELSE '' END;
            senders := coalesce(senders, '{}');  -- (rows gone since the head was read)
            ranked := coalesce(ranked, '{}');
            scores := coalesce(scores, '{}');
            wanted := array_fill(per_sender, ARRAY[cardinality(senders)]);
            FOR attempt IN 1 .. 3 LOOP
                -- The full ranking's choice when every row not read scores above the
                -- last one ranked in.
                EXIT WHEN unread IS NULL
                          OR (cardinality(ranked) >= slots AND scores[cardinality(scores)] < unread);
                -- Else read on, for the senders whose next rows may rank in: the rows
                -- up to the cut (the ranking then is the full one), or when too few
                -- were read, up to the lags' bound below; the last time, all of them.
                target := CASE
                    WHEN attempt = 3 THEN 'Infinity'
                    WHEN cardinality(ranked) >= slots THEN scores[cardinality(scores)]
                    WHEN attempt = 1 THEN (
                        SELECT min((caps[i] * average + f.lag_sum) / f.m) + average
                        FROM (SELECT row_number() OVER w AS m, sum(l.lag) OVER w AS lag_sum
                              FROM unnest(sender_lags) AS l(lag)
                              WINDOW w AS (ORDER BY l.lag ROWS UNBOUNDED PRECEDING)) f)
                    ELSE 'Infinity' END;
                WITH s AS (
                    SELECT u.*,
                           CASE WHEN u.cnt = u.want AND u.cnt < caps[i]
                                     AND u.lag + (u.cnt + 1) * averages[i] <= target
                                -- (in float: far behind, or an average near 0, is many rows;
                                -- one row more at least, whatever the rounding)
                                THEN greatest(u.cnt + 1, least(caps[i],
                                         floor((target - u.lag) / average + 1e-9) + 1))::integer
                                ELSE u.want END AS upto
                    FROM unnest(senders, sender_lags, counts, wanted, lasts)
                         WITH ORDINALITY AS u(sender_key, lag, cnt, want, last, n)
                ), x AS MATERIALIZED (
                    SELECT s.n, f.workqueue_id AS id, s.lag + (s.cnt + f.k) * averages[i] AS score
                    FROM s CROSS JOIN LATERAL (
                        SELECT o.workqueue_id, row_number() OVER (ORDER BY o.workqueue_id) AS k
                        FROM (SELECT q.workqueue_id FROM pepsi.workqueue q
                              WHERE q.stage = stages[i] AND q.status = 'pending'
                                AND q.sender_key = s.sender_key AND q.workqueue_id > s.last
                              ORDER BY q.stage, q.sender_key, q.workqueue_id
                              LIMIT s.upto - s.cnt) o
                    ) f
                    WHERE s.upto > s.want
                ), t AS MATERIALIZED (
                    SELECT s.n, s.lag, s.cnt + count(x.id)::integer AS cnt, s.upto AS want,
                           coalesce(max(x.id), s.last) AS last
                    FROM s LEFT JOIN x ON x.n = s.n
                    GROUP BY s.n, s.lag, s.cnt, s.upto, s.last
                ), r AS MATERIALIZED (
                    SELECT v.id, v.score
                    FROM (SELECT * FROM unnest(ranked, scores) AS v(id, score)
                          UNION ALL
                          SELECT x.id, x.score FROM x WHERE x.id <> ALL(head)) v
                    ORDER BY v.score, v.id
                    LIMIT slots
                )
                SELECT (SELECT array_agg(t.cnt ORDER BY t.n) FROM t),
                       (SELECT array_agg(t.want ORDER BY t.n) FROM t),
                       (SELECT array_agg(t.last ORDER BY t.n) FROM t),
                       coalesce((SELECT array_agg(r.id ORDER BY r.score, r.id) FROM r), '{}'),
                       coalesce((SELECT array_agg(r.score ORDER BY r.score, r.id) FROM r), '{}'),
                       (SELECT min(t.lag + (t.cnt + 1) * averages[i]) FROM t
                        WHERE t.cnt = t.want AND t.cnt < caps[i])
                INTO counts, wanted, lasts, ranked, scores, unread;
            END LOOP;
            picked := picked || head || ranked;
            CONTINUE;
        ELSE
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
