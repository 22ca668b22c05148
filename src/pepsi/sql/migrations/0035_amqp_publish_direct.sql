-- 0035: an AMQP publish to a queue whose consumers have room, and that has nothing
-- pending, is written `running`: the dispatcher's listener hands it to its consumers
-- when the commit returns, without a claim (issue 36; docs/amqp.md, "Direct
-- delivery"). `running` says which rows (NULL: none); the ids of those rows come back,
-- in the order given. The ids are taken here, as workqueue_publish_plain does, so
-- that they can be returned.
DROP FUNCTION pepsi.amqp_publish(text[], text[], text[], inet[], text[], text[], jsonb[],
                                 timestamptz[], bytea[], bytea[], smallint[]);
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
