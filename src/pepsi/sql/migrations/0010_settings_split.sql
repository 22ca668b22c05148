-- 0010: per-address settings and the lazy split (W-9).

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
-- recipients (a stale plan). One statement: the split is all or nothing, and
-- sends no NOTIFY (the worker's own completion wakes the dispatcher).
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
             state, body_id)
        SELECT w.stage, 'pending', w.arrived, w.expires, w.message_id, w.sender, r.recipients,
               w.origin_user, w.origin_peer, w.header_from, w.subject, w.content_type,
               w.correlation_id, w.properties, w.state || jsonb_build_object('split_from', id),
               w.body_id
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
