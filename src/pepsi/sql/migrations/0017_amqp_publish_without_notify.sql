-- 0017: pepsi.amqp_publish no longer sends NOTIFY workqueue.
--
-- Its only caller is the AMQP listener's publish batcher, which runs in the
-- dispatcher's own process (A-1): after each commit it wakes the dispatcher's
-- loop directly. The notification made PostgreSQL queue and deliver a message
-- per batch, and the dispatcher read it on its LISTEN connection and ran a
-- cycle for it. In twelve alternating rounds of bench/amqp.py's publish phase
-- (pika, 1 KB persistent messages): 21 600 -> 22 800 msg/s (medians), the
-- dispatcher's CPU per message 26.5 -> 25.2 us and PostgreSQL's 19.5 -> 18.8.
-- pepsi.workqueue_publish (queues with a length limit) still notifies.

CREATE OR REPLACE FUNCTION pepsi.amqp_publish(
    stages text[],
    message_ids text[],
    origin_users text[],
    origin_peers inet[],
    content_types text[],
    correlation_ids text[],
    properties jsonb[],
    expires timestamptz[],
    headers bytea[],
    bodies bytea[]
) RETURNS void
LANGUAGE sql AS $$
    SELECT set_config('synchronous_commit', 'on', true);
    WITH input AS (
        SELECT u.*, CASE WHEN u.header IS NOT NULL OR u.body IS NOT NULL
                         THEN nextval('pepsi.workqueue_body_body_id_seq') END AS new_body_id
        FROM unnest(stages, message_ids, origin_users, origin_peers, content_types,
                    correlation_ids, properties, expires, headers, bodies) WITH ORDINALITY
             AS u(stage, message_id, origin_user, origin_peer, content_type, correlation_id,
                  properties, expires, header, body, ord)
    ), stored_bodies AS (
        INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
        SELECT i.new_body_id, i.header, i.body FROM input i WHERE i.new_body_id IS NOT NULL
    )
    INSERT INTO pepsi.workqueue
        (stage, message_id, origin_user, origin_peer, content_type, correlation_id,
         properties, expires, body_id, sender_key)
    SELECT i.stage, i.message_id, i.origin_user, i.origin_peer, i.content_type,
           i.correlation_id, coalesce(i.properties, '{}'), i.expires, i.new_body_id,
           pepsi.workqueue_sender_key(i.origin_user, i.origin_peer, NULL, '{}')
    FROM input i
    ORDER BY i.ord
$$;
