-- The whole current schema of Pepsi, for a fresh install.
--
-- Keep it equal to replaying sql/migrations/ in order: a test builds one
-- database each way and requires the same catalog. The installer records the
-- schema version (pepsi.schema_version) after running this file.

CREATE SCHEMA pepsi;

CREATE TYPE pepsi.workqueue_status AS ENUM ('pending', 'running', 'paused', 'failed', 'timeout');

-- D-2: header block and body, shared by every row split from one message.
CREATE TABLE pepsi.workqueue_body (
    body_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    header  bytea,
    body    bytea,
    created timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE pepsi.workqueue_body SET (vacuum_truncate = false);  -- as pepsi.workqueue
-- Stored as they are: a queue keeps a body for seconds to days, and pglz cost
-- 6-10 times the insert of a text body over 2 KB (7 of a base64 attachment, which
-- it then kept as it was), and its load again (0030).
ALTER TABLE pepsi.workqueue_body
    ALTER COLUMN header SET STORAGE EXTERNAL,
    ALTER COLUMN body SET STORAGE EXTERNAL;

-- D-1: one row per message per position in the pipeline.
CREATE TABLE pepsi.workqueue (
    workqueue_id   bigserial PRIMARY KEY,           -- order of arrival = FIFO order
    stage          text NOT NULL,
    status         pepsi.workqueue_status NOT NULL DEFAULT 'pending',
    timeout        timestamptz,                     -- when a paused row is due
    arrived        timestamptz NOT NULL DEFAULT now(),
    expires        timestamptz,                     -- per-message expiry (TTL)
    -- envelope and origin
    message_id     text,
    sender         text,                            -- '' = null sender
    recipients     text[] NOT NULL DEFAULT '{}',
    origin_user    text,                            -- authenticated submitter
    origin_peer    inet,                            -- connecting peer
    -- extracted headers and producer properties
    header_from    text,
    subject        text,
    content_type   text,
    correlation_id text,
    properties     jsonb NOT NULL DEFAULT '{}',
    -- stage state: last_error, strikes, temporary_failures, failed_stage, ...
    state          jsonb NOT NULL DEFAULT '{}',
    -- No foreign key (migration 0016): its checks cost PostgreSQL about 5 µs a
    -- published row and 6 µs a deleted one, and every writer that refers to an
    -- existing body copies it from a row it holds locked (see workqueue_body).
    body_id        bigint,
    -- D-3: who the fair scheduler charges for this row.
    -- (filled by the trigger workqueue_sender_key, below)
    sender_key     text NOT NULL,
    -- higher first (AMQP x-max-priority, priority=); 0: none (migration 0024)
    priority       smallint NOT NULL DEFAULT 0
);

-- D-3: sender_key from the row, for every writer (a stored generated column was
-- recomputed by every UPDATE, whatever it set: a claim cost 20 µs a row, 8 without).
CREATE FUNCTION pepsi.workqueue_sender_key(
    origin_user text, origin_peer inet, sender text, recipients text[]
) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN origin_user IS NOT NULL THEN 'user:' || origin_user
        WHEN origin_peer IS NOT NULL THEN 'ip:' || CASE
            WHEN family(origin_peer) = 6 THEN network(set_masklen(origin_peer, 64))::text
            ELSE host(origin_peer)
        END
        WHEN coalesce(sender, '') <> '' THEN
            'from:' || lower(coalesce(substring(sender FROM '@([^@]*)$'), sender))
        ELSE
            'null:' || lower(coalesce(substring(recipients[1] FROM '@([^@]*)$'),
                                      recipients[1], ''))
    END
$$;

CREATE FUNCTION pepsi.workqueue_sender_key_fill() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.sender_key := pepsi.workqueue_sender_key(NEW.origin_user, NEW.origin_peer,
                                                 NEW.sender, NEW.recipients);
    RETURN NEW;
END
$$;

-- The WHEN clauses are evaluated inline: a writer that supplies the right key (the
-- publish functions do) skips the PL/pgSQL call, about 2 µs a row. Each statement
-- plans them again, and inlining pepsi.workqueue_sender_key parses its text (about
-- 35 µs): an INSERT's clause only proves the keys the publishers write, with a few
-- operators (about 5 µs); any other inserted row goes through the function (0025).
CREATE TRIGGER workqueue_sender_key
    BEFORE UPDATE OF origin_user, origin_peer, sender, recipients, sender_key
    ON pepsi.workqueue
    FOR EACH ROW
    WHEN (NEW.sender_key IS DISTINCT FROM pepsi.workqueue_sender_key(
        NEW.origin_user, NEW.origin_peer, NEW.sender, NEW.recipients))
    EXECUTE FUNCTION pepsi.workqueue_sender_key_fill();
CREATE TRIGGER workqueue_sender_key_insert
    BEFORE INSERT ON pepsi.workqueue
    FOR EACH ROW
    WHEN (NOT coalesce(NEW.sender_key = 'user:' || NEW.origin_user
                       OR (NEW.sender_key = 'null:' AND NEW.origin_user IS NULL
                           AND NEW.origin_peer IS NULL AND NEW.sender IS NULL
                           AND cardinality(NEW.recipients) = 0), false))
    EXECUTE FUNCTION pepsi.workqueue_sender_key_fill();

-- Rows advance with non-HOT updates (status is in the partial indexes), so
-- dead tuples pile up at the head of the pending index: vacuum early.
ALTER TABLE pepsi.workqueue SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_analyze_scale_factor = 0.02,
    -- A vacuum that finds the end of a drained queue empty would take an
    -- exclusive lock on it (retried for up to 5 s) to cut pages that the next
    -- burst extends again: keep them.
    vacuum_truncate = false
);

-- D-4: the claim's paths, and the paused sweep's.
CREATE INDEX workqueue_pending_idx ON pepsi.workqueue (stage, workqueue_id)
    WHERE status = 'pending';
CREATE INDEX workqueue_pending_sender_idx ON pepsi.workqueue (stage, sender_key, workqueue_id)
    WHERE status = 'pending';
CREATE INDEX workqueue_paused_idx ON pepsi.workqueue (timeout)
    WHERE status = 'paused';
-- Rows with a priority, for the claims to take first: empty, and free, without any.
CREATE INDEX workqueue_pending_priority_idx
    ON pepsi.workqueue (stage, priority DESC, workqueue_id)
    WHERE status = 'pending' AND priority > 0;
CREATE INDEX workqueue_pending_sender_priority_idx
    ON pepsi.workqueue (stage, sender_key, priority DESC, workqueue_id)
    WHERE status = 'pending' AND priority > 0;
CREATE INDEX workqueue_body_id_idx ON pepsi.workqueue (body_id)
    WHERE body_id IS NOT NULL;

-- A row that changes body (rare: nothing in Pepsi does it) still releases the old one
-- row by row.
CREATE FUNCTION pepsi.workqueue_body_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM pepsi.workqueue_body WHERE body_id = OLD.body_id FOR UPDATE;
    IF NOT EXISTS (SELECT 1 FROM pepsi.workqueue WHERE body_id = OLD.body_id) THEN
        DELETE FROM pepsi.workqueue_body WHERE body_id = OLD.body_id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER workqueue_body_release
    AFTER UPDATE OF body_id ON pepsi.workqueue
    FOR EACH ROW WHEN (OLD.body_id IS NOT NULL AND NEW.body_id IS DISTINCT FROM OLD.body_id)
    EXECUTE FUNCTION pepsi.workqueue_body_release();

-- D-2: the bodies of a DELETE's rows go with the last row that references them.
-- Locked first, in body_id order (two concurrent deletes of a body's last two rows:
-- the second waits for the first to commit, then sees no row left), then deleted in
-- a statement of its own, whose snapshot sees that commit. The transition table has
-- no statistics and the tables' own may be from a moment they were empty: the
-- planner then walked a whole index once per deleted row (14 s for one batch of
-- acknowledgements). Only index probes, driven by the array of body ids.
CREATE FUNCTION pepsi.workqueue_body_release_deleted() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan  -- one generic plan per statement (0028)
AS $$
DECLARE
    ids bigint[];
BEGIN
    ids := ARRAY(SELECT DISTINCT o.body_id FROM released o
                 WHERE o.body_id IS NOT NULL ORDER BY o.body_id);
    IF cardinality(ids) = 0 THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM pepsi.workqueue_body b
    WHERE b.body_id = ANY(ids)
    ORDER BY b.body_id
    FOR UPDATE OF b;
    -- A scalar subquery, not NOT EXISTS: it cannot become a join (which stale
    -- statistics turned into a walk of the whole body_id index per body).
    DELETE FROM pepsi.workqueue_body b
    WHERE b.body_id = ANY(ids)
      AND (SELECT w.workqueue_id FROM pepsi.workqueue w
           WHERE w.body_id = b.body_id LIMIT 1) IS NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER workqueue_body_release_deleted
    AFTER DELETE ON pepsi.workqueue
    REFERENCING OLD TABLE AS released
    FOR EACH STATEMENT EXECUTE FUNCTION pepsi.workqueue_body_release_deleted();
-- pepsi.workqueue_body_gc() collects whatever still escapes (a writer in
-- REPEATABLE READ, a body inserted without a row).

-- Sweep orphaned bodies: examines at most max_examined bodies after
-- after_id (the caller keeps the cursor, so each call costs the same however
-- large the queue), deletes those no row references, and returns how many it
-- deleted and the last body_id it examined (0 when it reached the end). Only
-- index probes: with statistics from a moment the tables were empty, the
-- planner's anti-join walked the whole body_id index once per body examined
-- (a single call took 46 s under the AMQP benchmark).
CREATE FUNCTION pepsi.workqueue_body_gc(
    after_id bigint DEFAULT 0,
    max_examined integer DEFAULT 10000,
    OUT deleted integer,
    OUT last_examined bigint
)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    WITH examined AS (
        SELECT b.body_id
        FROM pepsi.workqueue_body b
        WHERE b.body_id > after_id
        ORDER BY b.body_id
        LIMIT least(greatest(max_examined, 1), 10000)
    ), orphan AS (
        SELECT b.body_id
        FROM pepsi.workqueue_body b
        WHERE b.body_id = ANY(ARRAY(SELECT e.body_id FROM examined e))
          AND (SELECT w.workqueue_id FROM pepsi.workqueue w
               WHERE w.body_id = b.body_id LIMIT 1) IS NULL
        FOR UPDATE OF b SKIP LOCKED
    ), gone AS (
        DELETE FROM pepsi.workqueue_body b
        WHERE b.body_id = ANY(ARRAY(SELECT o.body_id FROM orphan o))
          AND (SELECT w.workqueue_id FROM pepsi.workqueue w
               WHERE w.body_id = b.body_id LIMIT 1) IS NULL
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM gone)::integer,
           CASE WHEN (SELECT count(*) FROM examined) < least(greatest(max_examined, 1), 10000)
                THEN 0
                ELSE (SELECT max(body_id) FROM examined)
           END
$$;

-- D-5: cumulative counters, written only by the dispatcher.
CREATE TABLE pepsi.stage_stats (
    stage              text PRIMARY KEY,
    processed          bigint NOT NULL DEFAULT 0,   -- status 0 reports
    failed             bigint NOT NULL DEFAULT 0,   -- non-zero statuses
    strikes            bigint NOT NULL DEFAULT 0,   -- crashes and hangs charged
    requeued           bigint NOT NULL DEFAULT 0,   -- given back without running
    busy_us            bigint NOT NULL DEFAULT 0,   -- worker time spent
    updated            timestamptz NOT NULL DEFAULT now(),
    -- by the outcome a worker names in its report (a program naming none counts only above)
    finished           bigint NOT NULL DEFAULT 0,   -- row deleted: the pipeline's end
    advanced           bigint NOT NULL DEFAULT 0,   -- moved on to another stage
    paused             bigint NOT NULL DEFAULT 0,   -- paused by the stage itself
    retries            bigint NOT NULL DEFAULT 0,   -- paused after a host failure
    timed_out          bigint NOT NULL DEFAULT 0    -- killed past MAX_RUNTIME
);

CREATE TABLE pepsi.dispatch_stats (
    name               text PRIMARY KEY DEFAULT 'pepsi-dispatch',
    claims             bigint NOT NULL DEFAULT 0,   -- claim statements run
    claimed            bigint NOT NULL DEFAULT 0,   -- rows claimed
    stages_executed    bigint NOT NULL DEFAULT 0,   -- worker passes (a fused chain is one)
    workers_started    bigint NOT NULL DEFAULT 0,
    workers_crashed    bigint NOT NULL DEFAULT 0,
    paused_resumed     bigint NOT NULL DEFAULT 0,
    bodies_collected   bigint NOT NULL DEFAULT 0,
    started            timestamptz,
    updated            timestamptz NOT NULL DEFAULT now(),
    wakeups_notify     bigint NOT NULL DEFAULT 0,   -- NOTIFY workqueue
    wakeups_worker     bigint NOT NULL DEFAULT 0,   -- a worker answered, started or exited
    wakeups_poll       bigint NOT NULL DEFAULT 0,   -- the POLL_INTERVAL heartbeat
    wakeups_timer      bigint NOT NULL DEFAULT 0,   -- a deadline: paused row due, MAX_RUNTIME, idle worker
    workers_retired    bigint NOT NULL DEFAULT 0,   -- stopped on purpose: idle, recycled, shutdown
    backpressure_events bigint NOT NULL DEFAULT 0,  -- 75 answers: a stage's cap halved
    serves             text[]                       -- its configuration's stages (0021)
);

-- The throughput chart's history (the web console): per minute and stage, what
-- the dispatcher's statistics flushes counted (status 0 reports, others), so
-- that the chart shows the last day after a restart, not only what one
-- console process has seen. Written by the flush (stats_flush), which also
-- deletes what is older than a day: at most 1 440 rows per stage.
CREATE TABLE pepsi.stage_stats_minute (
    minute     timestamptz NOT NULL,   -- the flush's minute
    stage      text NOT NULL,
    processed  bigint NOT NULL DEFAULT 0,
    failed     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, stage)
);

-- D-5: per-address overrides of stage options (W-9).
CREATE TABLE pepsi.settings (
    address  text NOT NULL,
    stage    text NOT NULL,
    options  jsonb NOT NULL DEFAULT '{}',
    updated  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (address, stage),
    CHECK (jsonb_typeof(options) = 'object')
);

-- D-5: configuration overlay stored in the database (P-10); a NULL value
-- removes the key from the file's configuration.
CREATE TABLE pepsi.config_override (
    section  text NOT NULL,
    key      text NOT NULL,
    value    text,
    updated  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (section, key)
);

-- D-5: the schema version every program checks at start.
CREATE TABLE pepsi.schema_version (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version     integer NOT NULL,
    fingerprint text NOT NULL,
    installed   timestamptz NOT NULL DEFAULT now()
);

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
        -- IS NOT DISTINCT FROM: by the primary key whatever the statistics (0022)
        WHERE w.workqueue_id = ANY(ids) AND w.status IS NOT DISTINCT FROM 'pending'
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

-- R-1, R-3, R-6: publish a batch in one round trip. Element i of every array
-- is message i (ord i, from 1); `recipients` holds each message's recipients
-- as an array literal (NULL: none), `properties` its producer properties
-- (NULL: {}). Returns, per message, its id and whether it was inserted
-- (false: a duplicate within the dedup window, whose original id is
-- returned). Length-limited stages (limit_* arrays, one element per stage)
-- are locked first, so publishes never overshoot MAX_LENGTH; the check runs
-- after the insert and either rejects the whole batch (SQLSTATE PP001) or
-- dead-letters the oldest pending rows (drop-head). One NOTIFY for the batch;
-- the commit is synchronous whatever the session's default.
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

-- The common case of workqueue_publish: no dedup, no length-limited stage,
-- only a stage, a header block and a body per message (either may be NULL;
-- both NULL: no body row). No plpgsql, no dedup or limit work. Returns the
-- ids in publish order (ascending: FIFO order is the order given). One
-- statement: the synchronous commit and the NOTIFY are functions in its FROM
-- list (run once), not a statement of their own (0025: one executor run fewer).
CREATE FUNCTION pepsi.workqueue_publish_plain(
    stages text[], headers bytea[], bodies bytea[]
) RETURNS SETOF bigint
LANGUAGE sql AS $$
    WITH input AS (
        SELECT u.stage, u.header, u.body, u.ord,
               nextval('pepsi.workqueue_workqueue_id_seq') AS new_id,
               CASE WHEN u.header IS NOT NULL OR u.body IS NOT NULL
                    THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM unnest(stages, headers, bodies) WITH ORDINALITY AS u(stage, header, body, ord)
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT i.new_body_id, i.header, i.body FROM input i WHERE i.new_body_id IS NOT NULL
    ), stored_rows AS (
        INSERT INTO pepsi.workqueue (workqueue_id, stage, body_id, sender_key)
        SELECT i.new_id, i.stage, i.new_body_id, pepsi.workqueue_sender_key(NULL, NULL, NULL, '{}')
        FROM input i
        ORDER BY i.ord
    )
    SELECT i.new_id
    FROM input i, set_config('synchronous_commit', 'on', true) AS sync,
         pg_notify('workqueue', '') AS notify
    ORDER BY i.ord
$$;

-- workqueue_publish_plain for a batch of one (a single publish): no arrays,
-- no numbering, one statement. Returns the message's id.
CREATE FUNCTION pepsi.workqueue_publish_one(stage text, header bytea, body bytea)
RETURNS bigint
LANGUAGE sql AS $$
    WITH stored_body AS (
        INSERT INTO pepsi.workqueue_body (header, body)
        SELECT header, body WHERE header IS NOT NULL OR body IS NOT NULL
        RETURNING body_id
    ), stored_row AS (
        INSERT INTO pepsi.workqueue (stage, body_id, sender_key)
        VALUES (stage, (SELECT b.body_id FROM stored_body b),
                pepsi.workqueue_sender_key(NULL, NULL, NULL, '{}'))
        RETURNING workqueue_id
    )
    SELECT r.workqueue_id
    FROM stored_row r, set_config('synchronous_commit', 'on', true) AS sync,
         pg_notify('workqueue', '') AS notify
$$;

-- The AMQP listener's publishes to queues without a length limit (A-2): only the
-- columns a basic.publish fills, no dedup, no limits, one row and one body per
-- element, in the order given. The rest of workqueue_publish's work, and the
-- five arrays of NULLs it would be sent, cost about a fifth of a publish. No
-- NOTIFY (migration 0017): its only caller is the dispatcher's own process, whose
-- batcher wakes the dispatcher's loop itself after the commit (P-3). The rows that
-- `running` marks are written running, for consumers that wait for them (direct
-- delivery, 0035): their ids come back, in the order given.
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
    priorities smallint[] DEFAULT NULL,
    running boolean[] DEFAULT NULL
) RETURNS SETOF bigint
LANGUAGE sql AS $$
    SELECT set_config('synchronous_commit', 'on', true);
    WITH input AS (
        SELECT u.*, nextval('pepsi.workqueue_workqueue_id_seq') AS new_id,
               CASE WHEN u.header IS NOT NULL OR u.body IS NOT NULL
                    THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM unnest(stages, message_ids, origin_users, origin_peers, content_types,
                    correlation_ids, properties, expires, headers, bodies, priorities,
                    running)
             WITH ORDINALITY
             AS u(stage, message_id, origin_user, origin_peer, content_type, correlation_id,
                  properties, expires, header, body, priority, running, ord)
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT i.new_body_id, i.header, i.body FROM input i WHERE i.new_body_id IS NOT NULL
    ), stored_rows AS (
        INSERT INTO pepsi.workqueue
            (workqueue_id, stage, status, message_id, origin_user, origin_peer, content_type,
             correlation_id, properties, expires, body_id, sender_key, priority)
        SELECT i.new_id, i.stage,
               CASE WHEN i.running THEN 'running' ELSE 'pending' END::pepsi.workqueue_status,
               i.message_id, i.origin_user, i.origin_peer, i.content_type,
               i.correlation_id, coalesce(i.properties, '{}'), i.expires, i.new_body_id,
               pepsi.workqueue_sender_key(i.origin_user, i.origin_peer, NULL, '{}'),
               coalesce(i.priority, 0)
        FROM input i
        ORDER BY i.ord
    )
    SELECT i.new_id FROM input i WHERE i.running ORDER BY i.ord
$$;

-- The n-th strike pauses the row for delays[n] seconds; the third (the
-- delivery limit, R-8) ends it: failed after a crash, timeout after a hang,
-- with state.failure_class crashed or timed-out. Returns the new strike
-- count, or 0 when the row is no longer running at that stage. The limit is
-- the dispatcher's (MAX_STRIKES), passed with every call: one source.
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

-- The pending senders of a stage after `after_key` (and up to `upto_key`
-- when given), by a loose index scan on workqueue_pending_sender_idx: one
-- index probe per sender, however many rows each has queued.
CREATE FUNCTION pepsi.workqueue_pending_senders(
    at_stage text, after_key text, upto_key text, max_senders integer
) RETURNS TABLE (sender_key text)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE s(k) AS (
        (SELECT q.sender_key FROM pepsi.workqueue q
         WHERE q.stage = at_stage AND q.status = 'pending' AND q.sender_key > after_key
         ORDER BY q.stage, q.sender_key, q.workqueue_id
         LIMIT 1)
        UNION ALL
        SELECT (SELECT q.sender_key FROM pepsi.workqueue q
                WHERE q.stage = at_stage AND q.status = 'pending' AND q.sender_key > s.k
                ORDER BY q.stage, q.sender_key, q.workqueue_id
                LIMIT 1)
        FROM s
        WHERE s.k IS NOT NULL AND (upto_key IS NULL OR s.k < upto_key)
    )
    SELECT k FROM s
    WHERE k IS NOT NULL AND (upto_key IS NULL OR k <= upto_key)
    LIMIT max_senders
$$;

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

-- P-4: the oldest-first claim (FAIR_SCHEDULING = no): for every stage with
-- free capacity, up to that stage's capacity of its pending rows, those with a
-- priority first (highest first), then the oldest; returned with their priority. Each
-- lateral orders by (stage, workqueue_id) under an equality on stage, which is
-- exactly the partial index, so the planner walks it and stops at the cap
-- instead of scanning the primary key with a filter on a skewed backlog. The
-- picked ids are folded into an array so the update finds its rows by primary
-- key rather than joining the whole table. A function for its settings: with
-- the statistics a vacuum of the drained queue leaves (no tuples in its
-- pages), the planner took a bitmap of every pending row of the stage and
-- sorted it (107 ms a claim on a 200 000-row backlog).
CREATE FUNCTION pepsi.workqueue_claim_fifo(stages text[], caps integer[])
RETURNS TABLE (workqueue_id bigint, stage text, priority smallint)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
-- One generic plan (0033): planned afresh, an idle claim took half as long again.
SET plan_cache_mode = force_generic_plan
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

-- P-4 + P-5: one call claims, for every stage, up to its capacity: first
-- fifo[i] of its oldest rows whatever the sender, then, among the oldest
-- caps[i] rows of each of at most max_senders pending senders (with rows that
-- have a priority pending: the highest first, for the head and each sender) (a window that
-- starts after starts[i] and wraps around), the rows ranked lowest by
-- lag + k × average (k-th oldest row of its sender; ties: oldest first).
-- Lags come as one JSON object, {stage: {sender: seconds}} (a sender looked
-- up by key, however many the dispatcher knows); a sender without one ranks
-- from 0. Returns the claimed ids with their stage and
-- sender, and where each stage's sender window starts next time ('' when
-- the window covered every sender).
CREATE FUNCTION pepsi.workqueue_claim_fair(
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
-- scan, and sorts only where no index gives the order. One generic plan of each
-- statement (0029): planned afresh, a claim of a few rows cost a fifth more.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET plan_cache_mode = force_generic_plan
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

-- What basic.deliver sends for one row a small claim just took for an AMQP consumer
-- (dispatch/services/claimer.py): amqp_delivery_load's columns as one record, so that
-- the dispatcher's read-ahead sends it without a load of its own, one statement fewer
-- on an AMQP message's way (issue 36). NULL for a row of a stage not in `for_stages`,
-- no longer running, or whose header and body pass `max_bytes` (loaded as before:
-- the claim's answer is read by the dispatcher's loop). VOLATILE, as
-- workqueue_claimed_rows: a snapshot of its own, taken after the claim. Per row, since
-- a SQL function cannot return record[].
CREATE FUNCTION pepsi.amqp_claimed_delivery(id bigint, for_stages text[], max_bytes integer)
RETURNS record
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT ROW(w.workqueue_id, w.properties ->> 'exchange', w.properties ->> 'routing_key',
               (w.state ->> 'delivery_count')::bigint, (w.state ->> 'redelivered')::boolean,
               w.state -> 'x_death', w.state -> 'x_first_death',
               extract(epoch FROM w.expires)::float8, b.header, b.body,
               CASE WHEN NOT w.properties ? 'exchange' THEN
                   jsonb_build_array(w.message_id, w.content_type, w.correlation_id,
                                     w.properties)
               END)
    FROM pepsi.workqueue w
    LEFT JOIN LATERAL (
        SELECT x.header, x.body FROM pepsi.workqueue_body x WHERE x.body_id = w.body_id LIMIT 1
    ) b ON true
    WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = ANY(for_stages)
      AND coalesce(octet_length(b.header), 0) + coalesce(octet_length(b.body), 0) <= max_bytes
$$;

-- After a claim, in its statement: which of `found` (the stages it took rows of)
-- that are among `for_stages` have no pending row left. VOLATILE: a snapshot of
-- its own, taken after the claim, so a row committed meanwhile counts; a row
-- committed later NOTIFYs, and that news outlasts this answer
-- (dispatch/policy/known_empty.py). One probe of the pending index per stage.
CREATE FUNCTION pepsi.workqueue_stages_drained(found text[], for_stages text[])
RETURNS text[]
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT coalesce(array_agg(s.stage), '{}')
    FROM (SELECT DISTINCT f.stage FROM unnest(found) AS f(stage)
          WHERE f.stage = ANY(for_stages)) s
    WHERE NOT EXISTS (SELECT 1 FROM pepsi.workqueue q
                      WHERE q.stage = s.stage AND q.status = 'pending')
$$;

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

-- Addresses are stored lower-cased (pepsi settings set does it; the worker
-- looks recipients up lower-cased): an override is one index probe on the
-- primary key per address. The worker asks, in its load query, whether its
-- stage has any override at all: one probe of this index per batch.
CREATE INDEX settings_stage_idx ON pepsi.settings (stage);

-- W-9: split a running row whose recipients resolve to different overrides.
-- `groups` is a JSON array of recipient arrays that partition the row's
-- recipients: the first group stays on the row, each other one becomes a new
-- pending row at the same stage, a copy of the row (same arrival, body
-- shared, state.split_from = id). Returns the new ids in group order, or
-- NULL (nothing changed) when the row is no longer running at `at_stage` (a
-- late call from a killed worker, a repair) or the groups are not exactly its
-- recipients (a stale plan). One statement: the split is all or nothing. Its
-- caller's statement (workqueue_split_many) sends the NOTIFY for the new rows.
CREATE FUNCTION pepsi.workqueue_split(id bigint, at_stage text, groups jsonb)
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

-- The durable AMQP 0-9-1 catalogue and its users (issue 16; docs/amqp.md).
-- Everything a RabbitMQ broker keeps in its metadata store lives here, so
-- that it survives restarts and can be read with SQL. Messages themselves
-- stay in pepsi.workqueue: an AMQP queue IS a stage, named by amqp_queue.stage.

-- Virtual hosts. '/' exists from the start, as in RabbitMQ.
CREATE TABLE pepsi.amqp_vhost (
    name    text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    created timestamptz NOT NULL DEFAULT now()
);

-- Users who may log in over AMQP (PLAIN, AMQPLAIN). password_hash is a
-- self-describing scrypt string (pepsi.amqp.auth.passwords), never the password.
CREATE TABLE pepsi.amqp_user (
    name          text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    password_hash text NOT NULL,
    tags          text[] NOT NULL DEFAULT '{}',
    created       timestamptz NOT NULL DEFAULT now(),
    updated       timestamptz NOT NULL DEFAULT now()
);

-- RabbitMQ's permissions: per user and vhost, three regular expressions
-- searched (unanchored) in resource names; '' grants nothing. Having a row at
-- all is what lets the user open the vhost.
CREATE TABLE pepsi.amqp_permission (
    username  text NOT NULL REFERENCES pepsi.amqp_user (name) ON DELETE CASCADE,
    vhost     text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    configure text NOT NULL,
    write     text NOT NULL,
    read      text NOT NULL,
    updated   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (username, vhost)
);
CREATE INDEX amqp_permission_vhost_idx ON pepsi.amqp_permission (vhost);

-- Exchanges. The default exchange is the row named '' (type direct); its
-- bindings (every queue under its own name) are implicit and never stored.
CREATE TABLE pepsi.amqp_exchange (
    vhost       text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    name        text NOT NULL CHECK (octet_length(name) <= 255),
    type        text NOT NULL CHECK (type IN ('direct', 'fanout', 'topic', 'headers')),
    durable     boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    internal    boolean NOT NULL DEFAULT false,
    arguments   jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, name)
);

-- The name of the stage an AMQP queue is: 'amqp:' VHOST ':' QUEUE, with '%'
-- and ':' of the vhost percent-encoded, so the first ':' after the prefix
-- ends the vhost and no two (vhost, queue) pairs share a stage. pepsi.conf
-- stage names cannot contain ':', so they never collide with these.
CREATE FUNCTION pepsi.amqp_queue_stage(vhost text, queue text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN 'amqp:' || replace(replace(vhost, '%', '%25'), ':', '%3A') || ':' || queue;

-- Queues. A queue is a stage: its messages are the pepsi.workqueue rows whose
-- stage is amqp_queue.stage (generated, hence always consistent).
CREATE TABLE pepsi.amqp_queue (
    vhost       text NOT NULL REFERENCES pepsi.amqp_vhost (name) ON DELETE CASCADE,
    name        text NOT NULL CHECK (name <> '' AND octet_length(name) <= 255),
    stage       text NOT NULL GENERATED ALWAYS AS (pepsi.amqp_queue_stage(vhost, name)) STORED,
    durable     boolean NOT NULL DEFAULT true,
    exclusive   boolean NOT NULL DEFAULT false,
    auto_delete boolean NOT NULL DEFAULT false,
    arguments   jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, name),
    UNIQUE (stage)
);

-- Bindings of a source exchange to a queue or to another exchange. The
-- generated columns carry the foreign keys, so deleting a queue or an
-- exchange (as source or destination) deletes its bindings, as in RabbitMQ.
-- Nothing binds to or from the default exchange.
CREATE TABLE pepsi.amqp_binding (
    vhost            text NOT NULL,
    source           text NOT NULL CHECK (source <> ''),
    destination      text NOT NULL,
    destination_kind text NOT NULL CHECK (destination_kind IN ('queue', 'exchange')),
    routing_key      text NOT NULL DEFAULT '',
    arguments        jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(arguments) = 'object'),
    queue_name       text GENERATED ALWAYS AS
        (CASE WHEN destination_kind = 'queue' THEN destination END) STORED,
    exchange_name    text GENERATED ALWAYS AS
        (CASE WHEN destination_kind = 'exchange' THEN destination END) STORED,
    created          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (vhost, source, destination_kind, destination, routing_key, arguments),
    FOREIGN KEY (vhost, source) REFERENCES pepsi.amqp_exchange (vhost, name) ON DELETE CASCADE,
    FOREIGN KEY (vhost, queue_name) REFERENCES pepsi.amqp_queue (vhost, name) ON DELETE CASCADE,
    FOREIGN KEY (vhost, exchange_name) REFERENCES pepsi.amqp_exchange (vhost, name)
        ON DELETE CASCADE,
    CHECK (destination_kind <> 'exchange' OR destination <> '')
);
CREATE INDEX amqp_binding_queue_idx ON pepsi.amqp_binding (vhost, queue_name)
    WHERE queue_name IS NOT NULL;
CREATE INDEX amqp_binding_exchange_idx ON pepsi.amqp_binding (vhost, exchange_name)
    WHERE exchange_name IS NOT NULL;

-- Every vhost gets RabbitMQ's predeclared exchanges when it is created,
-- whoever creates it (`pepsi amqp vhost add`, the install, plain SQL).
CREATE FUNCTION pepsi.amqp_vhost_predeclare() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pepsi.amqp_exchange (vhost, name, type)
    VALUES (NEW.name, '', 'direct'),
           (NEW.name, 'amq.direct', 'direct'),
           (NEW.name, 'amq.fanout', 'fanout'),
           (NEW.name, 'amq.topic', 'topic'),
           (NEW.name, 'amq.headers', 'headers'),
           (NEW.name, 'amq.match', 'headers');
    RETURN NULL;
END
$$;
CREATE TRIGGER amqp_vhost_predeclare AFTER INSERT ON pepsi.amqp_vhost
    FOR EACH ROW EXECUTE FUNCTION pepsi.amqp_vhost_predeclare();

INSERT INTO pepsi.amqp_vhost (name) VALUES ('/');

-- 0013: a message's outcome recorded in the stage's own transaction (issue 18).
CREATE FUNCTION pepsi.workqueue_claim_token(id bigint, stage text)
RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT w.xmin::text FROM pepsi.workqueue w
    WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = workqueue_claim_token.stage;
$$;

CREATE FUNCTION pepsi.workqueue_record_outcome(
    id bigint, stage text, token text, outcome text,
    next_stage text DEFAULT NULL, until timestamptz DEFAULT NULL,
    reason text DEFAULT NULL, state jsonb DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    touched integer;
BEGIN
    IF outcome = 'finish' THEN
        DELETE FROM pepsi.workqueue w
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'advance' THEN
        IF next_stage IS NULL THEN
            RAISE EXCEPTION 'advance needs a next_stage' USING ERRCODE = '22023';
        END IF;
        UPDATE pepsi.workqueue w
        SET stage = next_stage, status = 'pending', timeout = NULL,
            state = coalesce(workqueue_record_outcome.state,
                             CASE WHEN next_stage = w.stage THEN w.state
                                  ELSE w.state - 'strikes' - 'temporary_failures' END)
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'pause' THEN
        UPDATE pepsi.workqueue w
        SET status = 'paused', timeout = coalesce(until, now()),
            state = coalesce(workqueue_record_outcome.state,
                             CASE WHEN reason IS NULL THEN w.state
                                  ELSE w.state || jsonb_build_object('pause_reason', reason) END)
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'fail' THEN
        UPDATE pepsi.workqueue w
        SET status = 'failed', timeout = NULL,
            state = coalesce(workqueue_record_outcome.state,
                             w.state || jsonb_build_object(
                                 'failed_stage', w.stage, 'failure_class', 'permanent',
                                 'last_error', coalesce(reason, 'permanent')))
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSE
        RAISE EXCEPTION 'unknown outcome %, expected advance, finish, pause or fail', outcome
            USING ERRCODE = '22023';
    END IF;
    GET DIAGNOSTICS touched = ROW_COUNT;
    RETURN touched = 1;
END;
$$;

-- The users who may log in to the SMTP/LMTP ingress (AUTH PLAIN, LOGIN), as
-- pepsi.amqp_user: password_hash is a scrypt string, never the password.
CREATE TABLE pepsi.mail_user (
    name          text PRIMARY KEY CHECK (name <> '' AND octet_length(name) <= 255),
    password_hash text NOT NULL,
    created       timestamptz NOT NULL DEFAULT now(),
    updated       timestamptz NOT NULL DEFAULT now()
);

-- Issue 32: a split outcome and the messages it makes, in one round trip.
-- parts: a JSON array, one object per group of recipients, in order:
--   {"recipients": [...], "stage": S, "status": ..., "timeout": ..., "state": {...}}
--   with "stage": null for a group that is finished (it leaves no row).
-- The first group that is not finished stays on the row; each other becomes a
-- new row cloned from it (sharing its body, state.split_from = id). With none,
-- the row is deleted. spawn: a JSON array of new messages ({"stage", "sender",
-- "recipients", "message_id", "header_from", "subject", "content_type",
-- "properties", "state"}), their header blocks and bodies in the two arrays
-- (element i for message i), pending at their stage. edits, new_header and
-- new_body: the stage's changes to the message (as workqueue_record_outcomes_edited), applied
-- before the clones are made. Returns the ids of the new rows (clones, then
-- spawned messages), or NULL (nothing written) when the row is no longer
-- running at `at_stage` with the claim `token` (NULL: any claim). The statement
-- that calls it (queries.sql) sends the NOTIFY for the new rows: the worker's
-- status line names only the row's own outcome.
CREATE FUNCTION pepsi.workqueue_record_split(
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

-- 0023: least privilege (issue 34). Publishing runs as the schema's owner, so that a
-- role allowed to publish (`pepsi setup roles`: pepsi_publisher) needs no privilege on
-- the tables: it cannot read others' messages, nor touch the configuration overlay.
-- search_path is fixed so that the caller's cannot change what the names mean.
ALTER FUNCTION pepsi.workqueue_publish SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_publish_plain SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_publish_one SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION pepsi.workqueue_publish, pepsi.workqueue_publish_plain,
    pepsi.workqueue_publish_one FROM PUBLIC;
