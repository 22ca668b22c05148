-- 0025: a single publish costs PostgreSQL about a third less (issue 36).
--
-- The trigger's WHEN clause is planned again by every statement that writes a row:
-- its call of pepsi.workqueue_sender_key is inlined, which parses the function's
-- text each time, about 35 µs a statement, as much as the row itself. An INSERT
-- now has a trigger of its own whose WHEN clause only proves the two keys the
-- publishers write (user:<origin_user>, and null: for a row with no origin, sender
-- or recipients) with a few operators, about 5 µs to plan; any other row is filled
-- by the same PL/pgSQL function as before (about 2 µs a row), so a value written by
-- hand never sticks. UPDATEs keep the exact check they had.
DROP TRIGGER workqueue_sender_key ON pepsi.workqueue;
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

-- The fast paths in one statement each: the synchronous commit and the NOTIFY are
-- functions in its FROM list (run once), not a statement of their own (one executor
-- run fewer, about 8 µs). Their privileges stay; their SECURITY DEFINER and
-- search_path are set again below, as CREATE OR REPLACE resets them.
CREATE OR REPLACE FUNCTION pepsi.workqueue_publish_plain(
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

CREATE OR REPLACE FUNCTION pepsi.workqueue_publish_one(stage text, header bytea, body bytea)
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

ALTER FUNCTION pepsi.workqueue_publish_plain SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_publish_one SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
