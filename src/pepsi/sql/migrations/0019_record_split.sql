-- 0019: a stage's outcome that splits its message's recipients and makes new
-- messages, in one round trip (issue 32: a relay delivers some recipients,
-- defers others, fails the rest, and writes the delivery status notifications
-- in the same transaction as that outcome).

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
-- running at `at_stage` with the claim `token` (NULL: any claim). No NOTIFY:
-- the worker's own status line wakes the dispatcher.
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
             properties, state, body_id)
        SELECT p.value ->> 'stage', (p.value ->> 'status')::pepsi.workqueue_status,
               (p.value ->> 'timeout')::timestamptz, w.arrived, w.expires, w.message_id,
               w.sender, ARRAY(SELECT jsonb_array_elements_text(p.value -> 'recipients')),
               w.origin_user, w.origin_peer, w.header_from, w.subject, w.content_type,
               w.correlation_id, w.properties,
               (p.value -> 'state') || jsonb_build_object('split_from', id), w.body_id
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
