-- 0014: cheaper updates and deletes of pepsi.workqueue rows.
--
-- Measured on PostgreSQL 18 (1 000-row batches, backend CPU per row):
--
-- * The stored generated column sender_key was recomputed by every UPDATE of
--   a row, whichever columns it set: a claim (status = 'running') cost 20 µs a
--   row, 8 µs without it. sender_key is now a plain column that a BEFORE
--   trigger fills from the row on INSERT and on an UPDATE of one of its inputs
--   (an UPDATE that sets sender_key itself gets it recomputed too): every
--   writer still gets it without knowing (D-3), and no one can set it.
-- * The body was released by a row trigger: a PL/pgSQL call with three
--   queries for each deleted row, 17 µs a row. A statement trigger now reads
--   the statement's deleted rows as a transition table and releases their
--   bodies in two set-based statements (lock them in order, then delete those
--   no row references any more: the same lock-then-check as before).
-- * The release and the orphan sweep (workqueue_body_gc) probe indexes only, however
--   stale the statistics: a join planned from an empty table's statistics walked a
--   whole index per body (one sweep took 46 s under bench/amqp.py).

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

ALTER TABLE pepsi.workqueue ALTER COLUMN sender_key DROP EXPRESSION;

CREATE TRIGGER workqueue_sender_key
    BEFORE INSERT OR UPDATE OF origin_user, origin_peer, sender, recipients, sender_key
    ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION pepsi.workqueue_sender_key_fill();

-- A row that changes body (rare: nothing in Pepsi does it) still releases the old one
-- row by row.
CREATE OR REPLACE FUNCTION pepsi.workqueue_body_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM pepsi.workqueue_body WHERE body_id = OLD.body_id FOR UPDATE;
    IF NOT EXISTS (SELECT 1 FROM pepsi.workqueue WHERE body_id = OLD.body_id) THEN
        DELETE FROM pepsi.workqueue_body WHERE body_id = OLD.body_id;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER workqueue_body_release ON pepsi.workqueue;
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

-- Sweep orphaned bodies: examines at most max_examined bodies after
-- after_id (the caller keeps the cursor, so each call costs the same however
-- large the queue), deletes those no row references, and returns how many it
-- deleted and the last body_id it examined (0 when it reached the end). Only
-- index probes: with statistics from a moment the tables were empty, the
-- planner's anti-join walked the whole body_id index once per body examined
-- (a single call took 46 s under the AMQP benchmark).
CREATE OR REPLACE FUNCTION pepsi.workqueue_body_gc(
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
