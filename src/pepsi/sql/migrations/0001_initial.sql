-- 0001: the first schema (workqueue, bodies, statistics, settings, overlay, version).

CREATE SCHEMA pepsi;

CREATE TYPE pepsi.workqueue_status AS ENUM ('pending', 'running', 'paused', 'failed', 'timeout');

-- D-2: header block and body, shared by every row split from one message.
CREATE TABLE pepsi.workqueue_body (
    body_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    header  bytea,
    body    bytea,
    created timestamptz NOT NULL DEFAULT now()
);

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
    body_id        bigint REFERENCES pepsi.workqueue_body (body_id),
    -- D-3: who the fair scheduler charges for this row.
    sender_key     text NOT NULL GENERATED ALWAYS AS (
        CASE
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
    ) STORED
);

-- Rows advance with non-HOT updates (status is in the partial indexes), so
-- dead tuples pile up at the head of the pending index: vacuum early.
ALTER TABLE pepsi.workqueue SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_analyze_scale_factor = 0.02
);

-- D-4: the claim's paths, and the paused sweep's.
CREATE INDEX workqueue_pending_idx ON pepsi.workqueue (stage, workqueue_id)
    WHERE status = 'pending';
CREATE INDEX workqueue_pending_sender_idx ON pepsi.workqueue (stage, sender_key, workqueue_id)
    WHERE status = 'pending';
CREATE INDEX workqueue_paused_idx ON pepsi.workqueue (timeout)
    WHERE status = 'paused';
CREATE INDEX workqueue_body_id_idx ON pepsi.workqueue (body_id)
    WHERE body_id IS NOT NULL;

-- D-2: a body goes with the last row that references it. The body row is
-- locked before the check, so of two concurrent deletes of its last two rows
-- the second waits for the first to commit and then sees the table empty;
-- pepsi.workqueue_body_gc() collects whatever still escapes (a writer in
-- REPEATABLE READ, a body inserted without a row).
CREATE FUNCTION pepsi.workqueue_body_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.body_id IS NOT NULL
       AND (TG_OP = 'DELETE' OR NEW.body_id IS DISTINCT FROM OLD.body_id) THEN
        PERFORM 1 FROM pepsi.workqueue_body WHERE body_id = OLD.body_id FOR UPDATE;
        IF NOT EXISTS (SELECT 1 FROM pepsi.workqueue WHERE body_id = OLD.body_id) THEN
            DELETE FROM pepsi.workqueue_body WHERE body_id = OLD.body_id;
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER workqueue_body_release
    AFTER DELETE OR UPDATE OF body_id ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION pepsi.workqueue_body_release();

-- Sweep orphaned bodies: examines at most max_examined bodies after
-- after_id (the caller keeps the cursor, so each call costs the same however
-- large the queue), deletes those no row references, and returns how many it
-- deleted and the last body_id it examined (0 when it reached the end).
CREATE FUNCTION pepsi.workqueue_body_gc(
    after_id bigint DEFAULT 0,
    max_examined integer DEFAULT 10000,
    OUT deleted integer,
    OUT last_examined bigint
)
LANGUAGE sql AS $$
    WITH examined AS (
        SELECT b.body_id
        FROM pepsi.workqueue_body b
        WHERE b.body_id > after_id
        ORDER BY b.body_id
        LIMIT least(greatest(max_examined, 1), 10000)
    ), orphan AS (
        SELECT b.body_id
        FROM pepsi.workqueue_body b
        JOIN examined e USING (body_id)
        WHERE NOT EXISTS (SELECT 1 FROM pepsi.workqueue w WHERE w.body_id = b.body_id)
        FOR UPDATE OF b SKIP LOCKED
    ), gone AS (
        DELETE FROM pepsi.workqueue_body b
        USING orphan o
        WHERE b.body_id = o.body_id
          AND NOT EXISTS (SELECT 1 FROM pepsi.workqueue w WHERE w.body_id = b.body_id)
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
    updated            timestamptz NOT NULL DEFAULT now()
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
    updated            timestamptz NOT NULL DEFAULT now()
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
