-- 0034: a small claim hands the dispatcher its AMQP consumers' rows (issue 36): the
-- read-ahead's load, one statement on an AMQP message's way, is skipped.
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
