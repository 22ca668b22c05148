-- 0024: message priority (issue 33): AMQP x-max-priority and `priority` in the
-- properties, `priority=` in the Python API and `--priority` in the CLI. Higher first,
-- FIFO within a priority, and within a sender under fair scheduling. Rows without a
-- priority (0) cost nothing more: the claims probe an index of the others, empty then.
ALTER TABLE pepsi.workqueue ADD COLUMN priority smallint NOT NULL DEFAULT 0;
-- Rows with a priority, for the claims to take first: empty, and free, without any.
CREATE INDEX workqueue_pending_priority_idx
    ON pepsi.workqueue (stage, priority DESC, workqueue_id)
    WHERE status = 'pending' AND priority > 0;
CREATE INDEX workqueue_pending_sender_priority_idx
    ON pepsi.workqueue (stage, sender_key, priority DESC, workqueue_id)
    WHERE status = 'pending' AND priority > 0;

DROP FUNCTION pepsi.workqueue_publish;
CREATE FUNCTION pepsi.workqueue_publish(
    stages text[],
    message_ids text[],
    dedups boolean[],
    senders text[],
    recipients text[],
    origin_users text[],
    origin_peers inet[],
    header_froms text[],
    subjects text[],
    content_types text[],
    correlation_ids text[],
    properties jsonb[],
    expires timestamptz[],
    headers bytea[],
    bodies bytea[],
    limit_stages text[] DEFAULT '{}',
    limit_lengths bigint[] DEFAULT '{}',
    limit_drop_heads boolean[] DEFAULT '{}',
    limit_bounces text[] DEFAULT '{}',
    dedup_window double precision DEFAULT 86400,
    priorities smallint[] DEFAULT NULL
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
    IF cardinality(limit_stages) > 0 THEN
        PERFORM pg_advisory_xact_lock(1885696116, hashtext(s.stage))
        FROM (SELECT l.stage FROM unnest(limit_stages) AS l(stage) ORDER BY l.stage) s;
    END IF;

    RETURN QUERY
    WITH input AS (
        SELECT u.*, coalesce(u.dedup, false) AS deduped,
               nextval('pepsi.workqueue_workqueue_id_seq') AS new_id,
               CASE WHEN u.header IS NOT NULL OR u.body IS NOT NULL
                    THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM unnest(stages, message_ids, dedups, senders, recipients, origin_users,
                    origin_peers, header_froms, subjects, content_types, correlation_ids,
                    properties, expires, headers, bodies, priorities) WITH ORDINALITY
             AS u(stage, message_id, dedup, sender, recipients, origin_user, origin_peer,
                  header_from, subject, content_type, correlation_id, properties, expires,
                  header, body, priority, ord)
    ), dedup AS (
        INSERT INTO pepsi.publish_dedup AS d (message_id, workqueue_id, published)
        SELECT i.message_id, i.new_id, now() FROM input i WHERE i.deduped
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
        FROM input i LEFT JOIN dedup x ON i.deduped AND x.message_id = i.message_id
        WHERE NOT i.deduped OR x.workqueue_id = i.new_id
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT f.new_body_id, f.header, f.body FROM fresh f WHERE f.new_body_id IS NOT NULL
    ), stored_rows AS (
        INSERT INTO pepsi.workqueue
            (workqueue_id, stage, message_id, sender, recipients, origin_user, origin_peer,
             header_from, subject, content_type, correlation_id, properties, expires, body_id,
             sender_key, priority)
        SELECT f.new_id, f.stage, f.message_id, f.sender, coalesce(f.recipients::text[], '{}'),
               f.origin_user, f.origin_peer, f.header_from, f.subject, f.content_type,
               f.correlation_id, coalesce(f.properties, '{}'), f.expires, f.new_body_id,
               pepsi.workqueue_sender_key(f.origin_user, f.origin_peer, f.sender,
                                          coalesce(f.recipients::text[], '{}')),
               coalesce(f.priority, 0)
        FROM fresh f
        ORDER BY f.ord
    )
    SELECT i.ord::integer, coalesce(x.workqueue_id, i.new_id),
           (NOT i.deduped OR x.workqueue_id = i.new_id)
    FROM input i LEFT JOIN dedup x ON i.deduped AND x.message_id = i.message_id
    ORDER BY i.ord;

    FOR lim IN  -- no rows (and no work) without limits
        SELECT * FROM unnest(limit_stages, limit_lengths, limit_drop_heads, limit_bounces)
            AS l(stage, max_length, drop_head, bounce)
    LOOP
        -- Two index probes bound the count: well under the limit, no counting.
        SELECT min(w.workqueue_id), max(w.workqueue_id) INTO lo, hi
        FROM pepsi.workqueue w WHERE w.stage = lim.stage AND w.status = 'pending';
        CONTINUE WHEN lo IS NULL OR hi - lo + 1 <= lim.max_length;
        SELECT count(*) INTO pending FROM (
            SELECT 1 FROM pepsi.workqueue w
            WHERE w.stage = lim.stage AND w.status = 'pending'
            ORDER BY w.stage, w.workqueue_id
            LIMIT lim.max_length + cardinality(stages)) s;
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

-- as migration 0023 made it
ALTER FUNCTION pepsi.workqueue_publish SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION pepsi.workqueue_publish FROM PUBLIC;

DROP FUNCTION pepsi.amqp_publish;
CREATE FUNCTION pepsi.amqp_publish(
    stages text[],
    message_ids text[],
    origin_users text[],
    origin_peers inet[],
    content_types text[],
    correlation_ids text[],
    properties jsonb[],
    expires timestamptz[],
    headers bytea[],
    bodies bytea[],
    priorities smallint[] DEFAULT NULL
) RETURNS void
LANGUAGE sql AS $$
    SELECT set_config('synchronous_commit', 'on', true);
    WITH input AS (
        SELECT u.*, CASE WHEN u.header IS NOT NULL OR u.body IS NOT NULL
                         THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM unnest(stages, message_ids, origin_users, origin_peers, content_types,
                    correlation_ids, properties, expires, headers, bodies, priorities)
             WITH ORDINALITY
             AS u(stage, message_id, origin_user, origin_peer, content_type, correlation_id,
                  properties, expires, header, body, priority, ord)
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT i.new_body_id, i.header, i.body FROM input i WHERE i.new_body_id IS NOT NULL
    )
    INSERT INTO pepsi.workqueue
        (stage, message_id, origin_user, origin_peer, content_type, correlation_id,
         properties, expires, body_id, sender_key, priority)
    SELECT i.stage, i.message_id, i.origin_user, i.origin_peer, i.content_type,
           i.correlation_id, coalesce(i.properties, '{}'), i.expires, i.new_body_id,
           pepsi.workqueue_sender_key(i.origin_user, i.origin_peer, NULL, '{}'),
           coalesce(i.priority, 0)
    FROM input i
    ORDER BY i.ord
$$;

DROP FUNCTION pepsi.workqueue_claim_fifo;  -- it returns the priority too
CREATE FUNCTION pepsi.workqueue_claim_fifo(stages text[], caps integer[])
RETURNS TABLE (workqueue_id bigint, stage text, priority smallint)
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
                -- rows with a priority first (their own index, empty without any),
                -- then the oldest; a row in both is claimed once
                (SELECT q.workqueue_id
                 FROM pepsi.workqueue q
                 WHERE q.stage = s.stage AND q.status = 'pending' AND q.priority > 0
                 ORDER BY q.stage, q.priority DESC, q.workqueue_id
                 LIMIT s.cap)
                UNION ALL
                (SELECT q.workqueue_id
                 FROM pepsi.workqueue q
                 WHERE q.stage = s.stage AND q.status = 'pending'
                 ORDER BY q.stage, q.workqueue_id
                 LIMIT s.cap)
                LIMIT s.cap
            ) c
          ))
      -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
      AND w.status IS NOT DISTINCT FROM 'pending'
    -- with the priority: the dispatcher serves the rows highest first, then oldest
    RETURNING w.workqueue_id, w.stage, w.priority
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
    WITH claimed AS (
        UPDATE pepsi.workqueue w SET status = 'running'
        -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
        WHERE w.workqueue_id = ANY(picked) AND w.status IS NOT DISTINCT FROM 'pending'
        RETURNING w.workqueue_id, w.stage, w.sender_key, w.priority
    )  -- in the order they are to be served: highest priority first, then oldest
    SELECT coalesce(array_agg(c.workqueue_id ORDER BY c.priority DESC, c.workqueue_id), '{}'),
           coalesce(array_agg(c.stage ORDER BY c.priority DESC, c.workqueue_id), '{}'),
           coalesce(array_agg(c.sender_key ORDER BY c.priority DESC, c.workqueue_id), '{}')
    INTO ids, id_stages, id_senders
    FROM claimed c;
END
$$;

-- a split's parts keep the message's priority
CREATE OR REPLACE FUNCTION pepsi.workqueue_split(id bigint, at_stage text, groups jsonb)
RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    row_recipients text[];
    planned text[];
    new_ids bigint[];
BEGIN
    SELECT w.recipients INTO row_recipients
    FROM pepsi.workqueue w
    WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = at_stage
    FOR UPDATE;
    IF NOT FOUND OR jsonb_typeof(groups) <> 'array' OR jsonb_array_length(groups) < 2 THEN
        RETURN NULL;
    END IF;
    planned := ARRAY(SELECT r FROM jsonb_array_elements(groups) g,
                                   jsonb_array_elements_text(g) r ORDER BY r);
    IF planned <> ARRAY(SELECT r FROM unnest(row_recipients) r ORDER BY r)
       OR EXISTS (SELECT 1 FROM jsonb_array_elements(groups) g
                  WHERE jsonb_typeof(g) <> 'array' OR jsonb_array_length(g) = 0) THEN
        RETURN NULL;
    END IF;
    WITH rest AS (
        SELECT ARRAY(SELECT jsonb_array_elements_text(g.value)) AS recipients, g.n
        FROM jsonb_array_elements(groups) WITH ORDINALITY AS g(value, n)
        WHERE g.n > 1
    ), made AS (
        INSERT INTO pepsi.workqueue
            (stage, status, arrived, expires, message_id, sender, recipients, origin_user,
             origin_peer, header_from, subject, content_type, correlation_id, properties,
             state, body_id, priority)
        SELECT w.stage, 'pending', w.arrived, w.expires, w.message_id, w.sender, r.recipients,
               w.origin_user, w.origin_peer, w.header_from, w.subject, w.content_type,
               w.correlation_id, w.properties, w.state || jsonb_build_object('split_from', id),
               w.body_id, w.priority
        FROM pepsi.workqueue w CROSS JOIN rest r
        WHERE w.workqueue_id = id
        ORDER BY r.n
        RETURNING workqueue_id
    )
    SELECT array_agg(m.workqueue_id ORDER BY m.workqueue_id) INTO new_ids FROM made m;
    UPDATE pepsi.workqueue w
    SET recipients = ARRAY(SELECT jsonb_array_elements_text(groups -> 0))
    WHERE w.workqueue_id = id;
    RETURN new_ids;
END
$$;

CREATE OR REPLACE FUNCTION pepsi.workqueue_record_split(
    id bigint, at_stage text, parts jsonb, spawn jsonb,
    spawn_headers bytea[], spawn_bodies bytea[],
    edits jsonb DEFAULT NULL, new_header bytea DEFAULT NULL, new_body bytea DEFAULT NULL,
    token text DEFAULT NULL
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    kept integer;
    clone_ids bigint[];
    spawned_ids bigint[];
    new_body_id bigint;
BEGIN
    PERFORM 1 FROM pepsi.workqueue w
    WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = at_stage
      AND (token IS NULL OR w.xmin::text = token)
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;

    IF new_header IS NOT NULL OR new_body IS NOT NULL THEN
        INSERT INTO pepsi.workqueue_body (header, body)
        SELECT coalesce(new_header, b.header), coalesce(new_body, b.body)
        FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b ON b.body_id = w.body_id
        WHERE w.workqueue_id = id
        RETURNING body_id INTO new_body_id;
    END IF;
    IF edits IS NOT NULL OR new_body_id IS NOT NULL THEN
        UPDATE pepsi.workqueue w
        SET message_id = CASE WHEN edits ? 'message_id' THEN edits ->> 'message_id'
                              ELSE w.message_id END,
            sender = CASE WHEN edits ? 'sender' THEN edits ->> 'sender' ELSE w.sender END,
            header_from = CASE WHEN edits ? 'header_from' THEN edits ->> 'header_from'
                               ELSE w.header_from END,
            subject = CASE WHEN edits ? 'subject' THEN edits ->> 'subject' ELSE w.subject END,
            content_type = CASE WHEN edits ? 'content_type' THEN edits ->> 'content_type'
                                ELSE w.content_type END,
            correlation_id = CASE WHEN edits ? 'correlation_id'
                                  THEN edits ->> 'correlation_id' ELSE w.correlation_id END,
            properties = CASE WHEN edits ? 'properties' THEN edits -> 'properties'
                              ELSE w.properties END,
            body_id = coalesce(new_body_id, w.body_id)
        WHERE w.workqueue_id = id;
    END IF;

    SELECT min(p.n) INTO kept
    FROM jsonb_array_elements(parts) WITH ORDINALITY AS p(value, n)
    WHERE jsonb_typeof(p.value -> 'stage') = 'string';

    WITH made AS (
        INSERT INTO pepsi.workqueue
            (stage, status, timeout, arrived, expires, message_id, sender, recipients,
             origin_user, origin_peer, header_from, subject, content_type, correlation_id,
             properties, state, body_id, priority)
        SELECT p.value ->> 'stage', (p.value ->> 'status')::pepsi.workqueue_status,
               (p.value ->> 'timeout')::timestamptz, w.arrived, w.expires, w.message_id,
               w.sender, ARRAY(SELECT jsonb_array_elements_text(p.value -> 'recipients')),
               w.origin_user, w.origin_peer, w.header_from, w.subject, w.content_type,
               w.correlation_id, w.properties,
               (p.value -> 'state') || jsonb_build_object('split_from', id), w.body_id,
               w.priority
        FROM pepsi.workqueue w
        CROSS JOIN jsonb_array_elements(parts) WITH ORDINALITY AS p(value, n)
        WHERE w.workqueue_id = id AND jsonb_typeof(p.value -> 'stage') = 'string'
          AND p.n <> kept
        ORDER BY p.n
        RETURNING workqueue_id
    )
    SELECT coalesce(array_agg(m.workqueue_id ORDER BY m.workqueue_id), '{}') INTO clone_ids
    FROM made m;

    IF kept IS NULL THEN
        DELETE FROM pepsi.workqueue w WHERE w.workqueue_id = id;
    ELSE
        UPDATE pepsi.workqueue w
        SET recipients = ARRAY(SELECT jsonb_array_elements_text(parts -> (kept - 1) -> 'recipients')),
            stage = parts -> (kept - 1) ->> 'stage',
            status = (parts -> (kept - 1) ->> 'status')::pepsi.workqueue_status,
            timeout = (parts -> (kept - 1) ->> 'timeout')::timestamptz,
            state = parts -> (kept - 1) -> 'state'
        WHERE w.workqueue_id = id;
    END IF;

    WITH input AS (
        SELECT s.value AS m, s.n, nextval('pepsi.workqueue_workqueue_id_seq') AS new_id,
               CASE WHEN spawn_headers[s.n] IS NOT NULL OR spawn_bodies[s.n] IS NOT NULL
                    THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM jsonb_array_elements(spawn) WITH ORDINALITY AS s(value, n)
    ), bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT i.new_body_id, spawn_headers[i.n], spawn_bodies[i.n]
        FROM input i WHERE i.new_body_id IS NOT NULL
    ), made AS (
        INSERT INTO pepsi.workqueue
            (workqueue_id, stage, message_id, sender, recipients, header_from, subject,
             content_type, properties, state, body_id, sender_key)
        SELECT i.new_id, i.m ->> 'stage', i.m ->> 'message_id', i.m ->> 'sender',
               ARRAY(SELECT jsonb_array_elements_text(coalesce(i.m -> 'recipients', '[]'))),
               i.m ->> 'header_from', i.m ->> 'subject', i.m ->> 'content_type',
               coalesce(i.m -> 'properties', '{}'), coalesce(i.m -> 'state', '{}'),
               i.new_body_id,
               pepsi.workqueue_sender_key(NULL, NULL, i.m ->> 'sender',
                   ARRAY(SELECT jsonb_array_elements_text(coalesce(i.m -> 'recipients', '[]'))))
        FROM input i
        ORDER BY i.n
        RETURNING workqueue_id
    )
    SELECT coalesce(array_agg(m.workqueue_id ORDER BY m.workqueue_id), '{}') INTO spawned_ids
    FROM made m;

    RETURN clone_ids || spawned_ids;
END
$$;
