-- Named queries, loaded once by name (pepsi.db.queries). Each begins with a
-- `-- name: entity_verb[_guard]` line and ends where the next one begins.

-- name: schema_version_get
SELECT version, fingerprint, installed FROM pepsi.schema_version;

-- name: schema_version_set
INSERT INTO pepsi.schema_version (singleton, version, fingerprint, installed)
VALUES (true, %(version)s, %(fingerprint)s, now())
ON CONFLICT (singleton) DO UPDATE
SET version = EXCLUDED.version, fingerprint = EXCLUDED.fingerprint, installed = now();

-- name: schema_exists
SELECT to_regclass('pepsi.schema_version') IS NOT NULL AS installed,
       to_regnamespace('pepsi') IS NOT NULL AS has_schema;

-- name: workqueue_count_by_stage_status
-- Rows per stage and status, statuses by name (ORDER BY takes the text
-- column): `pepsi db status`, `pepsi queue status`, `pepsi top`. A scan.
SELECT stage, status::text AS status, count(*) AS messages
FROM pepsi.workqueue
GROUP BY stage, status
ORDER BY stage, status;

-- name: workqueue_vacuum
-- The dispatcher's vacuum at the pace of the traffic (dispatch/services/vacuum.py); a
-- table autovacuum is already processing is skipped, not waited for.
VACUUM (SKIP_LOCKED) pepsi.workqueue, pepsi.workqueue_body;

-- name: workqueue_body_gc
SELECT deleted, last_examined FROM pepsi.workqueue_body_gc(%(after_id)s, %(max_examined)s);

-- name: workqueue_load_running
-- A worker loads the rows it was handed, with their header blocks and bodies when
-- its stage reads them (see pepsi.workqueue_load_running): one generic plan, a
-- primary key probe per row and per body (0028).
SELECT workqueue_id, stage, arrived, message_id, sender, recipients, origin_user,
       origin_peer, header_from, subject, content_type, correlation_id, properties, state,
       sender_key, body_id, header, body, deferred, token
FROM pepsi.workqueue_load_running(%(ids)s::bigint[], %(stage)s, %(with_header)s,
                                  %(with_body)s, %(inline)s);

-- name: workqueue_load_metadata
-- workqueue_load_running for a stage that reads neither the header block nor
-- the body (W-8's batched, metadata-only stage), in the same columns: one
-- generic plan, a primary key probe (see pepsi.workqueue_load_metadata).
SELECT workqueue_id, stage, arrived, message_id, sender, recipients, origin_user,
       origin_peer, header_from, subject, content_type, correlation_id, properties, state,
       sender_key, body_id, NULL::bytea AS header, NULL::bytea AS body, false AS deferred,
       token
FROM pepsi.workqueue_load_metadata(%(ids)s::bigint[], %(stage)s);

-- name: workqueue_load_running_with_settings
-- As workqueue_load_running, for a stage that has per-address overrides
-- (W-9): each row also carries the overrides of its correspondent at this
-- stage, {address: options} (NULL: none), the envelope sender for a
-- state.local_origin message, else each recipient, lower-cased, and its domain's
-- entry (two primary key probes per address); and whether the stage still has any.
SELECT w.workqueue_id, w.stage, w.arrived, w.message_id, w.sender, w.recipients,
       w.origin_user, host(w.origin_peer), w.header_from, w.subject, w.content_type,
       w.correlation_id, w.properties, w.state, w.sender_key, w.body_id,
       CASE WHEN octet_length(b.header) <= %(inline)s THEN b.header END AS header,
       CASE WHEN %(with_body)s AND octet_length(b.body) <= %(inline)s THEN b.body END AS body,
       coalesce(octet_length(b.header) > %(inline)s
                OR (%(with_body)s AND octet_length(b.body) > %(inline)s), false) AS deferred,
       (SELECT jsonb_object_agg(s.address, s.options)
        FROM pepsi.settings s
        WHERE s.stage = %(stage)s
          AND s.address = ANY (ARRAY(
              SELECT k FROM unnest(
                  CASE WHEN w.state -> 'local_origin' = 'true'::jsonb
                       THEN ARRAY[w.sender] ELSE w.recipients END) AS a,
                  LATERAL (VALUES (lower(a)), (lower(split_part(a, '@', -1)))) AS v(k)
              WHERE k <> ''))) AS overrides,
       EXISTS (SELECT 1 FROM pepsi.settings s WHERE s.stage = %(stage)s) AS any_override,
       w.xmin::text AS token
FROM pepsi.workqueue w
LEFT JOIN LATERAL (  -- the header block and body: one probe, or none (see above)
    SELECT x.header, x.body FROM pepsi.workqueue_body x
    WHERE x.body_id = w.body_id AND %(with_header)s
    LIMIT 1
) b ON true
WHERE w.workqueue_id = ANY(%(ids)s::bigint[]) AND w.status = 'running' AND w.stage = %(stage)s;

-- name: settings_exist_for_stage
-- Whether a stage has any per-address override: a worker asks at most every
-- few seconds, and loads with the plain query while the answer is no.
SELECT EXISTS (SELECT 1 FROM pepsi.settings WHERE stage = %(stage)s);

-- name: settings_stages_overridden
-- W-10: the stages with per-address overrides: a worker does not fuse into them.
SELECT coalesce(array_agg(DISTINCT stage), '{}') FROM pepsi.settings;

-- name: workqueue_split_many
-- W-9: split the rows of a batch whose recipients diverge, in one round trip
-- (see pepsi.workqueue_split); per row, the new ids (NULL: not split). The new
-- rows are pending: a NOTIFY at the commit wakes the dispatcher for them (a
-- worker's answer that finished or paused its message does not).
SELECT s.workqueue_id, pepsi.workqueue_split(s.workqueue_id, %(stage)s, s.groups)
FROM pg_notify('workqueue', '') AS notify,
     jsonb_to_recordset(%(splits)s::jsonb) AS s(workqueue_id bigint, groups jsonb)
ORDER BY s.workqueue_id;

-- name: settings_merge
-- pepsi settings set: lay options ({KEY: value}) over an address's at a stage.
INSERT INTO pepsi.settings AS s (address, stage, options)
VALUES (%(address)s, %(stage)s, %(options)s::jsonb)
ON CONFLICT (address, stage)
DO UPDATE SET options = s.options || excluded.options, updated = now()
RETURNING s.address, s.stage, s.options, s.updated;

-- name: settings_get_by_address
SELECT address, stage, options, updated FROM pepsi.settings
WHERE address = %(address)s ORDER BY stage;

-- name: settings_list
-- Every override, or one stage's (its index); in address order.
SELECT address, stage, options, updated FROM pepsi.settings
WHERE %(stage)s::text IS NULL OR stage = %(stage)s
ORDER BY address, stage;

-- name: settings_delete_keys
-- Remove some options of an address at a stage; the row goes with its last
-- option (an empty override would only cost the worker a lookup).
WITH cur AS (
    SELECT s.address, s.stage, s.options - %(keys)s::text[] AS rest
    FROM pepsi.settings s
    WHERE s.address = %(address)s AND s.stage = %(stage)s AND s.options ?| %(keys)s::text[]
    FOR UPDATE
), emptied AS (
    DELETE FROM pepsi.settings s USING cur
    WHERE s.address = cur.address AND s.stage = cur.stage AND cur.rest = '{}'::jsonb
    RETURNING 1
), kept AS (
    UPDATE pepsi.settings s SET options = cur.rest, updated = now()
    FROM cur
    WHERE s.address = cur.address AND s.stage = cur.stage AND cur.rest <> '{}'::jsonb
    RETURNING 1
)
SELECT count(*) FROM cur;

-- name: settings_delete_stage
DELETE FROM pepsi.settings WHERE address = %(address)s AND stage = %(stage)s;

-- name: settings_delete_address
DELETE FROM pepsi.settings WHERE address = %(address)s;

-- name: workqueue_body_get
SELECT CASE WHEN %(with_header)s THEN header END, body
FROM pepsi.workqueue_body WHERE body_id = %(body_id)s;

-- name: workqueue_record_outcomes
-- Every outcome of a batch in one round trip (W-2, W-8): finished rows deleted, the
-- others updated from a JSON array (see pepsi.workqueue_record_outcomes: one
-- generic plan of primary key probes, 0028).
SELECT pepsi.workqueue_record_outcomes(%(stage)s, %(finished)s::bigint[], %(updates)s::jsonb);

-- name: workqueue_claim_fifo
-- P-4: one statement claims, for every stage with free capacity, up to that
-- stage's capacity of its oldest pending rows (see pepsi.workqueue_claim_fifo).
-- `commit` 'off': the claim's commit does not wait for its WAL flush (NULL: the
-- session's synchronous_commit); set for this statement's transaction only,
-- and read at its commit, so the order of the two FROM items does not matter.
-- A claim of at most `rows_max` rows also returns the rows of `rows_for`'s stages
-- (pepsi.workqueue_claimed_rows; NULL otherwise): the count over all the rows makes
-- the claim run to its end first.
-- The first row also says which of the stages it took rows of the claim left without
-- a pending row (pepsi.workqueue_stages_drained: every stage asked is probed). A small
-- claim returns, for the rows of `amqp_for`'s stages, what basic.deliver sends
-- (pepsi.amqp_claimed_delivery, up to `amqp_bytes` of header and body; a record: read
-- in binary).
SELECT c.workqueue_id, c.stage, c.priority,
       CASE WHEN count(*) OVER () <= %(rows_max)s AND c.stage = ANY(%(rows_for)s::text[])
            THEN (pepsi.workqueue_claimed_rows(ARRAY[c.workqueue_id],
                                               %(rows_for)s::text[]))[1] END,
       CASE WHEN row_number() OVER () = 1
            THEN pepsi.workqueue_stages_drained(array_agg(c.stage) OVER (),
                                                %(stages)s::text[]) END,
       CASE WHEN count(*) OVER () <= %(rows_max)s AND c.stage = ANY(%(amqp_for)s::text[])
            THEN pepsi.amqp_claimed_delivery(c.workqueue_id, %(amqp_for)s::text[],
                                             %(amqp_bytes)s) END
FROM set_config('synchronous_commit',
                coalesce(%(commit)s::text, current_setting('synchronous_commit')), true) AS s,
     pepsi.workqueue_claim_fifo(%(stages)s::text[], %(caps)s::integer[]) AS c;

-- name: workqueue_requeue_running
-- Give claimed rows back (never ran, or their worker died): only rows still
-- running at the stage they were claimed at.
UPDATE pepsi.workqueue
SET status = 'pending'
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND status = 'running' AND stage = %(stage)s;

-- name: workqueue_reset_running
-- P-2: at start, rows left running by a previous dispatcher go back to pending
-- (an AMQP queue's may have reached a consumer: they are marked redelivered).
UPDATE pepsi.workqueue
SET status = 'pending',
    state = CASE WHEN stage LIKE 'amqp:%%' THEN state || '{"redelivered": true}' ELSE state END
WHERE status = 'running';

-- name: workqueue_reset_running_except
-- After the dispatcher reconnects: running rows none of its workers holds
-- (a claim whose answer was lost) go back to pending.
UPDATE pepsi.workqueue
SET status = 'pending',
    state = CASE WHEN stage LIKE 'amqp:%%' THEN state || '{"redelivered": true}' ELSE state END
WHERE status = 'running' AND NOT (workqueue_id = ANY(%(held)s::bigint[]));

-- name: workqueue_resume_due
-- P-8: flip paused rows that are due, and tell when the next one falls due.
WITH due AS (
    UPDATE pepsi.workqueue
    SET status = 'pending', timeout = NULL
    WHERE status = 'paused' AND timeout <= now()
    RETURNING 1
)
SELECT (SELECT count(*) FROM due) AS resumed,
       (SELECT extract(epoch FROM min(timeout) - now()) FROM pepsi.workqueue
        WHERE status = 'paused' AND timeout > now())::float8 AS next_due_in;

-- name: dispatcher_lock_try
-- P-1: the singleton lock, key 1885696115 ('peps'), held for the session.
SELECT pg_try_advisory_lock(1885696115);

-- name: dispatcher_lock_holder
-- Who holds the dispatcher's lock, read from pg_locks (never taken); since when.
SELECT a.pid, a.client_addr::text, a.client_hostname, a.application_name, a.backend_start
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.database = (
        SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = 0 AND l.objid = 1885696115 AND l.objsubid = 1
  AND l.pid <> pg_backend_pid()
LIMIT 1;

-- name: config_override_list
-- The database overlay, read by every program (pepsi.config.overlay).
SELECT section, key, value FROM pepsi.config_override ORDER BY section, key;

-- name: workqueue_publish
SELECT out_ord, out_id, out_inserted FROM pepsi.workqueue_publish(%b::text[], %b::text[], %b::boolean[], %b::text[], %b::text[], %b::text[], %b::inet[], %b::text[], %b::text[], %b::text[], %b::text[], %b::jsonb[], %b::timestamptz[], %b::bytea[], %b::bytea[], %b::text[], %b::bigint[], %b::boolean[], %b::text[], %b, %b::smallint[])

-- name: workqueue_publish_plain
SELECT * FROM pepsi.workqueue_publish_plain(%b::text[], %b::bytea[], %b::bytea[])

-- name: workqueue_publish_one
SELECT pepsi.workqueue_publish_one(%b::text, %b::bytea, %b::bytea)

-- name: workqueue_publish_one_prepared
SELECT pepsi.workqueue_publish_one($1::text, $2::bytea, $3::bytea)

-- name: amqp_publish
-- The AMQP listener's batch for queues without a length limit (pepsi.amqp_publish);
-- the ids of the rows written running for waiting consumers (direct delivery), in order.
SELECT * FROM pepsi.amqp_publish(%b::text[], %b::text[], %b::text[], %b::inet[], %b::text[], %b::text[], %b::jsonb[], %b::timestamptz[], %b::bytea[], %b::bytea[], %b::smallint[], %b::boolean[])

-- name: database_exists
-- The embedded server's first start: is the `pepsi` database there yet?
SELECT 1 FROM pg_database WHERE datname = %(name)s;

-- name: database_create
-- The name is an identifier, composed with psycopg.sql: a parameter cannot be one.
CREATE DATABASE {name};

-- name: cluster_quorum_setting
-- `pepsi cluster status`: the quorum rule Patroni set on the primary.
SHOW synchronous_standby_names;

-- name: role_set_password
-- The embedded server's superuser gets a SCRAM verifier computed by libpq, so the
-- secret itself never reaches the server or its log; composed: ALTER takes no parameter.
ALTER ROLE {role} PASSWORD {verifier};

-- name: server_conf_load_time
-- Before a reload of pg_hba.conf: a new session reports a later time once it is applied.
SELECT pg_conf_load_time();

-- name: server_reload_conf
SELECT pg_reload_conf();

-- name: workqueue_expire
-- R-10: dead-letter pending rows past their stage's TTL or their own expiry.
SELECT pepsi.workqueue_expire(%(stages)s::text[], %(ttls)s::float8[], %(bounces)s::text[],
                              %(max_rows)s);

-- name: publish_dedup_sweep
SELECT pepsi.publish_dedup_sweep(%(window)s, %(max_rows)s);

-- name: workqueue_strike
-- W-6: the head message of a worker that crashed or hung gets a strike.
SELECT pepsi.workqueue_strike(%(id)s, %(stage)s, %(kind)s, %(reason)s, %(delays)s::float8[],
                              %(max_strikes)s);

-- name: workqueue_pause_if_running
-- W-4: a message whose worker lost the database pauses for a while.
UPDATE pepsi.workqueue
SET status = 'paused',
    timeout = now() + make_interval(secs => %(seconds)s),
    state = state || jsonb_build_object('last_error', %(reason)s::text)
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND status = 'running' AND stage = %(stage)s;

-- name: workqueue_resume_db_paused
-- W-4: the database is back (the dispatcher reconnected): the messages paused because
-- their worker lost it go on now, not at the end of DB_ERROR_PAUSE (only pauses due
-- within it, on workqueue_paused_idx).
UPDATE pepsi.workqueue
SET status = 'pending', timeout = NULL
WHERE status = 'paused' AND timeout <= now() + make_interval(secs => %(within)s)
  AND state->>'last_error' = %(reason)s;

-- name: workqueue_bounce_failed
SELECT pepsi.workqueue_bounce_failed(%(stages)s::text[], %(sink)s, %(max_rows)s);

-- name: workqueue_claim_fair
-- P-5: the fair claim for all stages at once (see pepsi.workqueue_claim_fair);
-- `commit`, `rows_max`, `rows_for`, `amqp_for` and `amqp_bytes`, and the drained
-- stages, as in workqueue_claim_fifo (the AMQP rows: a record, or NULL, per id).
SELECT c.ids, c.id_stages, c.id_senders, c.next_starts,
       CASE WHEN cardinality(c.ids) BETWEEN 1 AND %(rows_max)s
                 AND cardinality(%(rows_for)s::text[]) > 0
            THEN pepsi.workqueue_claimed_rows(c.ids, %(rows_for)s::text[]) END,
       CASE WHEN cardinality(c.ids) > 0
            THEN pepsi.workqueue_stages_drained(c.id_stages, %(stages)s::text[]) END,
       CASE WHEN cardinality(c.ids) BETWEEN 1 AND %(rows_max)s
                 AND c.id_stages && %(amqp_for)s::text[]
            THEN ARRAY(SELECT CASE WHEN u.stage = ANY(%(amqp_for)s::text[])
                                   THEN pepsi.amqp_claimed_delivery(
                                            u.id, %(amqp_for)s::text[], %(amqp_bytes)s) END
                       FROM unnest(c.ids, c.id_stages) WITH ORDINALITY AS u(id, stage, n)
                       ORDER BY u.n) END
FROM set_config('synchronous_commit',
                coalesce(%(commit)s::text, current_setting('synchronous_commit')), true) AS s,
     pepsi.workqueue_claim_fair(
         %(stages)s::text[], %(caps)s::integer[], %(fifo)s::integer[], %(averages)s::float8[],
         %(starts)s::text[], %(lags)s::jsonb, %(max_senders)s) AS c;

-- name: workqueue_heads_by_stage
-- `pepsi queue status`, per stage: the oldest pending row's age (one probe of
-- the pending index) and the next paused row's due time (one pass over the
-- paused rows for all stages: the paused index is by time, not stage, so a
-- probe per stage would read them all once per stage).
WITH paused AS (
    SELECT q.stage, min(q.timeout) AS next_retry FROM pepsi.workqueue q
    WHERE q.status = 'paused' AND q.timeout IS NOT NULL
    GROUP BY q.stage
)
SELECT s.stage,
       (SELECT extract(epoch FROM now() - q.arrived) FROM pepsi.workqueue q
        WHERE q.stage = s.stage AND q.status = 'pending'
        ORDER BY q.stage, q.workqueue_id LIMIT 1) AS oldest_pending_s,
       p.next_retry
FROM unnest(%(stages)s::text[]) AS s(stage)
LEFT JOIN paused p ON p.stage = s.stage;

-- name: workqueue_count_failures_by_class
SELECT stage, status::text, coalesce(state->>'failure_class', '?'), count(*)
FROM pepsi.workqueue WHERE status IN ('failed', 'timeout')
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3;

-- name: workqueue_list
SELECT workqueue_id, stage, status::text, arrived, timeout, sender_key, message_id,
       state->>'last_error', coalesce((state->>'strikes')::int, 0)
FROM pepsi.workqueue
WHERE (%(stage)s::text IS NULL OR stage = %(stage)s)
  AND (%(status)s::text IS NULL OR status = %(status)s::pepsi.workqueue_status)
  AND (%(sender_key)s::text IS NULL OR sender_key = %(sender_key)s)
ORDER BY workqueue_id
LIMIT %(limit)s;

-- name: workqueue_get
-- One message with its body's sizes; the header and body only when asked for.
SELECT w.workqueue_id, w.stage, w.status::text, w.arrived, w.timeout, w.expires, w.message_id,
       w.sender, w.recipients, w.origin_user, host(w.origin_peer), w.sender_key, w.header_from,
       w.subject, w.content_type, w.correlation_id, w.properties, w.state,
       length(b.header), length(b.body),
       CASE WHEN %(with_body)s THEN b.header END, CASE WHEN %(with_body)s THEN b.body END
FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)
WHERE w.workqueue_id = %(id)s;

-- name: dispatcher_lock_try_xact
-- A repair's test that no dispatcher runs (admin/queue_repair.py). Held until the end
-- of the repair's transaction: no dispatcher runs, and none can start, while a
-- repair touches running rows.
SELECT pg_try_advisory_xact_lock(1885696115);

-- name: workqueue_resume_paused
UPDATE pepsi.workqueue SET status = 'pending', timeout = NULL
WHERE status = 'paused' AND workqueue_id = ANY(%(ids)s::bigint[])
RETURNING workqueue_id;

-- name: workqueue_retry_failed
-- Failed or timed out: pending again at the stage it failed at, counts reset.
UPDATE pepsi.workqueue
SET status = 'pending', timeout = NULL,
    stage = coalesce(state->>'failed_stage', stage),
    state = state - 'strikes' - 'temporary_failures' - 'failure_class' - 'failed_stage'
            - 'dead_letter_reason'
WHERE status IN ('failed', 'timeout') AND workqueue_id = ANY(%(ids)s::bigint[])
RETURNING workqueue_id;

-- name: workqueue_move_unless_running
-- Running rows only with allow_running: the repair holds the dispatcher's lock.
UPDATE pepsi.workqueue SET stage = %(to)s, status = 'pending', timeout = NULL
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND (status <> 'running' OR %(allow_running)s)
RETURNING workqueue_id;

-- name: workqueue_delete_unless_running
-- Running rows only with allow_running, as workqueue_move_unless_running.
DELETE FROM pepsi.workqueue
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND (status <> 'running' OR %(allow_running)s)
RETURNING workqueue_id;

-- name: workqueue_select_matching
-- The ids a repair applies to: given ids, or every row matching the selectors.
SELECT workqueue_id, status::text FROM pepsi.workqueue
WHERE (cardinality(%(ids)s::bigint[]) = 0 OR workqueue_id = ANY(%(ids)s::bigint[]))
  AND (%(stage)s::text IS NULL OR stage = %(stage)s
       OR state->>'failed_stage' = %(stage)s)
  AND (%(failure_class)s::text IS NULL OR state->>'failure_class' = %(failure_class)s)
  AND status = ANY(%(statuses)s::pepsi.workqueue_status[])
ORDER BY workqueue_id;

-- name: stats_flush
-- P-9: every counter delta in one statement (one transaction); the chart's minutes too,
-- and the minutes older than a day go.
WITH stage_minute AS (
    INSERT INTO pepsi.stage_stats_minute AS m (minute, stage, processed, failed)
    SELECT date_trunc('minute', now()), stage, processed, failed
    FROM unnest(%(stages)s::text[], %(processed)s::bigint[], %(failed)s::bigint[])
         AS d (stage, processed, failed)
    WHERE processed > 0 OR failed > 0
    ON CONFLICT (minute, stage) DO UPDATE
    SET processed = m.processed + EXCLUDED.processed, failed = m.failed + EXCLUDED.failed
    RETURNING 1
), old_minutes AS (
    DELETE FROM pepsi.stage_stats_minute WHERE minute < now() - interval '1 day'
    RETURNING 1
), stage_delta AS (
    INSERT INTO pepsi.stage_stats AS s
        (stage, processed, failed, strikes, requeued, busy_us,
         finished, advanced, paused, retries, timed_out)
    SELECT * FROM unnest(%(stages)s::text[], %(processed)s::bigint[], %(failed)s::bigint[],
                         %(strikes)s::bigint[], %(requeued)s::bigint[], %(busy_us)s::bigint[],
                         %(finished)s::bigint[], %(advanced)s::bigint[], %(paused)s::bigint[],
                         %(retries)s::bigint[], %(timed_out)s::bigint[])
    ON CONFLICT (stage) DO UPDATE
    SET processed = s.processed + EXCLUDED.processed, failed = s.failed + EXCLUDED.failed,
        strikes = s.strikes + EXCLUDED.strikes, requeued = s.requeued + EXCLUDED.requeued,
        busy_us = s.busy_us + EXCLUDED.busy_us, finished = s.finished + EXCLUDED.finished,
        advanced = s.advanced + EXCLUDED.advanced, paused = s.paused + EXCLUDED.paused,
        retries = s.retries + EXCLUDED.retries, timed_out = s.timed_out + EXCLUDED.timed_out,
        updated = now()
    RETURNING 1
)
INSERT INTO pepsi.dispatch_stats AS d
    (name, claims, claimed, stages_executed, workers_started, workers_crashed, paused_resumed,
     bodies_collected, wakeups_notify, wakeups_worker, wakeups_poll, wakeups_timer,
     workers_retired, backpressure_events, started)
VALUES ('pepsi-dispatch', %(d_claims)s, %(d_claimed)s, %(d_stages_executed)s,
        %(d_workers_started)s, %(d_workers_crashed)s, %(d_paused_resumed)s,
        %(d_bodies_collected)s, %(d_wakeups_notify)s, %(d_wakeups_worker)s,
        %(d_wakeups_poll)s, %(d_wakeups_timer)s, %(d_workers_retired)s,
        %(d_backpressure_events)s, %(started)s)
ON CONFLICT (name) DO UPDATE
SET claims = d.claims + EXCLUDED.claims, claimed = d.claimed + EXCLUDED.claimed,
    stages_executed = d.stages_executed + EXCLUDED.stages_executed,
    workers_started = d.workers_started + EXCLUDED.workers_started,
    workers_crashed = d.workers_crashed + EXCLUDED.workers_crashed,
    paused_resumed = d.paused_resumed + EXCLUDED.paused_resumed,
    bodies_collected = d.bodies_collected + EXCLUDED.bodies_collected,
    wakeups_notify = d.wakeups_notify + EXCLUDED.wakeups_notify,
    wakeups_worker = d.wakeups_worker + EXCLUDED.wakeups_worker,
    wakeups_poll = d.wakeups_poll + EXCLUDED.wakeups_poll,
    wakeups_timer = d.wakeups_timer + EXCLUDED.wakeups_timer,
    workers_retired = d.workers_retired + EXCLUDED.workers_retired,
    backpressure_events = d.backpressure_events + EXCLUDED.backpressure_events,
    started = EXCLUDED.started, updated = now();

-- name: workqueue_notify
-- Only writers outside the dispatcher's loop notify (P-3): repairs, once each.
NOTIFY workqueue;

-- name: workqueue_listen
LISTEN workqueue;

-- name: config_listen
-- P-10: `pepsi config reload|set|unset` (and whoever edits the overlay) say so here.
LISTEN config_changed;

-- name: config_notify_changed
NOTIFY config_changed;

-- name: config_override_upsert
INSERT INTO pepsi.config_override (section, key, value) VALUES (%(section)s, %(key)s, %(value)s)
ON CONFLICT (section, key) DO UPDATE SET value = EXCLUDED.value, updated = now();

-- name: config_override_delete
DELETE FROM pepsi.config_override WHERE section = %(section)s AND key = %(key)s;

-- name: telemetry_listen
-- P-11: the telemetry switch changed; every live worker is retired.
LISTEN telemetry_changed;

-- name: amqp_listen
-- AMQP users, permissions, vhosts or the catalogue changed (pepsi amqp, another writer).
LISTEN amqp_changed;

-- name: server_version
SHOW server_version;

-- name: schema_install_lock
-- Concurrent installers serialise on this lock, held until the transaction ends.
SELECT pg_advisory_xact_lock(hashtext('pepsi.schema'));

-- name: stats_stage_all
-- `pepsi top`: the cumulative counters it turns into rates (one row per stage).
SELECT stage, processed, failed, finished, advanced, retries, strikes FROM pepsi.stage_stats;

-- name: dispatch_serves_set
-- The stages this dispatcher serves (its configuration's), at its start and each reload.
INSERT INTO pepsi.dispatch_stats AS d (name, serves) VALUES ('pepsi-dispatch', %(stages)s)
ON CONFLICT (name) DO UPDATE SET serves = EXCLUDED.serves;

-- name: dispatch_serves_get
-- The stages the (last) dispatcher said it serves; no row, or NULL: not known.
SELECT serves FROM pepsi.dispatch_stats WHERE name = 'pepsi-dispatch';

-- name: stats_stage_recent
-- `pepsi top` before a second flush: each stage's processed and failed counts of the
-- last minute and this one (pepsi.stage_stats_minute, a range of its primary key).
SELECT stage, sum(processed), sum(failed) FROM pepsi.stage_stats_minute
WHERE minute >= date_trunc('minute', now()) - interval '1 minute'
GROUP BY stage;

-- name: stats_recent_since
-- Where stats_stage_recent's counts start.
SELECT date_trunc('minute', now()) - interval '1 minute';

-- name: stats_dispatch_latest
-- `pepsi top`: claim counters and the last flush, with the server's clock so the
-- flush age does not depend on the client's; one row even before any flush.
SELECT now(), d.claims, d.claimed, d.updated
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT claims, claimed, updated FROM pepsi.dispatch_stats ORDER BY updated DESC LIMIT 1
) d ON true;

-- name: activity_count_workers
-- `pepsi top`: each worker process holds one connection named pepsi-worker:<stage>.
SELECT application_name, count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'pepsi-worker:%'
GROUP BY 1;

-- name: activity_oldest_horizon
-- The oldest transaction of this database holding back vacuum's horizon (admin/horizon.py):
-- a session with a transaction id or a snapshot (idle in transaction, a long query) or a
-- prepared transaction. No row: nothing holds it. Other users' sessions show only to a
-- superuser or a member of pg_read_all_stats.
SELECT kind, age_s, pid, usename, application_name, client, state, gid FROM (
    SELECT 'session' AS kind, extract(epoch FROM now() - xact_start)::float8 AS age_s, pid,
           usename::text, application_name,
           coalesce(host(client_addr) || ':' || client_port, 'local') AS client,
           state, NULL::text AS gid
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
      AND backend_type = 'client backend' AND xact_start IS NOT NULL
      AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
      -- a lazy VACUUM's snapshot does not hold back other vacuums (the dispatcher's own)
      AND pid NOT IN (SELECT pid FROM pg_stat_progress_vacuum)
    UNION ALL
    SELECT 'prepared', extract(epoch FROM now() - prepared)::float8, NULL, owner::text,
           NULL, NULL, NULL, gid
    FROM pg_prepared_xacts
    WHERE database = current_database()
) AS holders
ORDER BY age_s DESC
LIMIT 1;

-- name: telemetry_worker_mark
-- P-11: a `pepsi worker` connection holds one of two shared locks for its session, next to
-- the dispatcher's 'peps' key: 1885696117 if it reports telemetry, 1885696118 if not, so
-- that `pepsi telemetry status` counts workers (not a stage's own connections) in pg_locks.
SELECT pg_advisory_lock_shared(CASE WHEN %(on)s THEN 1885696117 ELSE 1885696118 END);

-- name: telemetry_count_workers
-- `pepsi telemetry status`: per stage, the workers with telemetry on, and with it off.
SELECT a.application_name,
       count(*) FILTER (WHERE l.objid = 1885696117),
       count(*) FILTER (WHERE l.objid = 1885696118)
FROM pg_stat_activity a
JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
     AND l.classid = 0 AND l.objid IN (1885696117, 1885696118) AND l.objsubid = 1
WHERE a.datname = current_database() AND a.application_name LIKE 'pepsi-worker:%'
GROUP BY 1 ORDER BY 1;

-- name: telemetry_notify_changed
-- P-11: sent after [pepsi] SHARE_TELEMETRY is rewritten; the dispatcher replaces its workers.
NOTIFY telemetry_changed;

-- AMQP users, vhosts and permissions (issue 16; pepsi.admin.accounts.amqp_users, the listener).

-- name: amqp_vhost_insert
INSERT INTO pepsi.amqp_vhost (name) VALUES (%(name)s)
ON CONFLICT (name) DO NOTHING
RETURNING name, created;

-- name: amqp_vhost_list
SELECT v.name, v.created,
       (SELECT count(*) FROM pepsi.amqp_queue q WHERE q.vhost = v.name),
       (SELECT count(*) FROM pepsi.amqp_exchange e WHERE e.vhost = v.name)
FROM pepsi.amqp_vhost v
ORDER BY v.name;

-- name: amqp_vhost_exists
SELECT EXISTS (SELECT 1 FROM pepsi.amqp_vhost WHERE name = %(name)s);

-- name: amqp_vhost_delete
-- The vhost with everything in it: exchanges, queues, bindings and permissions
-- go by cascade, the messages of its queues' stages here. One statement, one snapshot.
WITH stages AS (
    SELECT stage FROM pepsi.amqp_queue WHERE vhost = %(name)s
), messages AS (
    DELETE FROM pepsi.workqueue w WHERE w.stage IN (SELECT stage FROM stages) RETURNING 1
), gone AS (
    DELETE FROM pepsi.amqp_vhost WHERE name = %(name)s RETURNING name
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM stages),
       (SELECT count(*) FROM messages);

-- name: amqp_user_insert
INSERT INTO pepsi.amqp_user (name, password_hash, tags)
VALUES (%(name)s, %(password_hash)s, %(tags)s)
ON CONFLICT (name) DO NOTHING
RETURNING name, tags, created, updated;

-- name: amqp_user_get
-- The listener's login: the stored hash and tags of one user (no row: no such user).
SELECT name, password_hash, tags FROM pepsi.amqp_user WHERE name = %(name)s;

-- name: amqp_user_list
SELECT name, tags, created, updated FROM pepsi.amqp_user ORDER BY name;

-- name: amqp_user_delete
DELETE FROM pepsi.amqp_user WHERE name = %(name)s RETURNING name;

-- name: amqp_user_set_password
UPDATE pepsi.amqp_user SET password_hash = %(password_hash)s, updated = now()
WHERE name = %(name)s
RETURNING name;

-- name: amqp_permission_set
-- Whether the user exists, whether the vhost does, and whether the permission was
-- written (only when both do). FOR KEY SHARE: neither can go before this commits.
WITH u AS (
    SELECT name FROM pepsi.amqp_user WHERE name = %(username)s FOR KEY SHARE
), v AS (
    SELECT name FROM pepsi.amqp_vhost WHERE name = %(vhost)s FOR KEY SHARE
), put AS (
    INSERT INTO pepsi.amqp_permission (username, vhost, configure, write, read)
    SELECT u.name, v.name, %(configure)s, %(write)s, %(read)s FROM u CROSS JOIN v
    ON CONFLICT (username, vhost) DO UPDATE
    SET configure = EXCLUDED.configure, write = EXCLUDED.write, read = EXCLUDED.read,
        updated = now()
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM u), EXISTS (SELECT 1 FROM v), EXISTS (SELECT 1 FROM put);

-- name: amqp_permission_get
-- The listener: one user's patterns in one vhost (no row: the vhost is closed to them).
SELECT configure, write, read FROM pepsi.amqp_permission
WHERE username = %(username)s AND vhost = %(vhost)s;

-- name: amqp_permission_delete
DELETE FROM pepsi.amqp_permission
WHERE username = %(username)s AND vhost = %(vhost)s
RETURNING username;

-- name: amqp_permission_list
SELECT username, vhost, configure, write, read FROM pepsi.amqp_permission
WHERE (%(vhost)s::text IS NULL OR vhost = %(vhost)s)
  AND (%(username)s::text IS NULL OR username = %(username)s)
ORDER BY vhost, username;

-- name: amqp_notify_changed
-- After a user, vhost or permission changed: a JSON payload {"kind", "name"[, "vhost"]},
-- so the listener can close the connections it no longer allows.
SELECT pg_notify('amqp_changed', %(payload)s);

-- name: amqp_exchange_list
-- The broker's view of one vhost (pepsi.amqp.broker.catalogue), read again after each change.
SELECT name, type, durable, auto_delete, internal, arguments
FROM pepsi.amqp_exchange WHERE vhost = %(vhost)s;

-- name: amqp_queue_list
SELECT name, stage, durable, exclusive, auto_delete, arguments
FROM pepsi.amqp_queue WHERE vhost = %(vhost)s;

-- name: amqp_binding_list
SELECT source, destination, destination_kind, routing_key, arguments
FROM pepsi.amqp_binding WHERE vhost = %(vhost)s;

-- name: amqp_exchange_insert
INSERT INTO pepsi.amqp_exchange (vhost, name, type, durable, auto_delete, internal, arguments)
VALUES (%(vhost)s, %(name)s, %(type)s, %(durable)s, %(auto_delete)s, %(internal)s,
        %(arguments)s)
ON CONFLICT (vhost, name) DO NOTHING;

-- name: amqp_exchange_delete
-- Its bindings, as source or destination, go by cascade.
DELETE FROM pepsi.amqp_exchange WHERE vhost = %(vhost)s AND name = %(name)s;

-- name: amqp_exchange_auto_delete
-- RabbitMQ's auto-delete: among the exchanges that just lost a binding, those flagged
-- auto_delete that are the source of no binding any more.
DELETE FROM pepsi.amqp_exchange e
WHERE e.vhost = %(vhost)s AND e.name = ANY(%(names)s) AND e.auto_delete
  AND NOT EXISTS (SELECT 1 FROM pepsi.amqp_binding b
                  WHERE b.vhost = e.vhost AND b.source = e.name)
RETURNING e.name;

-- name: amqp_binding_insert
INSERT INTO pepsi.amqp_binding
    (vhost, source, destination, destination_kind, routing_key, arguments)
VALUES (%(vhost)s, %(source)s, %(destination)s, %(destination_kind)s, %(routing_key)s,
        %(arguments)s)
ON CONFLICT DO NOTHING;

-- name: amqp_binding_delete
DELETE FROM pepsi.amqp_binding
WHERE vhost = %(vhost)s AND source = %(source)s AND destination = %(destination)s
  AND destination_kind = %(destination_kind)s AND routing_key = %(routing_key)s
  AND arguments = %(arguments)s;

-- name: amqp_queue_insert
-- A queue is a stage: the generated column names it.
INSERT INTO pepsi.amqp_queue (vhost, name, durable, exclusive, auto_delete, arguments)
VALUES (%(vhost)s, %(name)s, %(durable)s, %(exclusive)s, %(auto_delete)s, %(arguments)s)
ON CONFLICT (vhost, name) DO NOTHING
RETURNING stage;

-- name: amqp_queue_message_count
-- queue.declare-ok's message_count: the stage's ready (pending) rows.
SELECT count(*) FROM pepsi.workqueue WHERE stage = %(stage)s AND status = 'pending';

-- name: amqp_queue_purge
WITH gone AS (
    DELETE FROM pepsi.workqueue WHERE stage = %(stage)s AND status = 'pending' RETURNING 1
)
SELECT count(*) FROM gone;

-- name: amqp_queue_delete
-- The queue (its bindings by cascade) and every row of its stage, in one statement.
WITH q AS (
    DELETE FROM pepsi.amqp_queue WHERE vhost = %(vhost)s AND name = %(name)s RETURNING stage
), gone AS (
    DELETE FROM pepsi.workqueue w WHERE w.stage IN (SELECT stage FROM q) RETURNING 1
)
SELECT count(*) FROM gone;

-- name: amqp_queue_delete_orphaned_exclusive
-- At the broker's start: exclusive queues belonged to connections of an earlier run
-- (one dispatcher per database, P-1), so they and their rows go.
WITH q AS (
    DELETE FROM pepsi.amqp_queue WHERE exclusive RETURNING stage
), gone AS (
    DELETE FROM pepsi.workqueue w WHERE w.stage IN (SELECT stage FROM q) RETURNING 1
)
SELECT (SELECT count(*) FROM q), (SELECT count(*) FROM gone);

-- name: amqp_delivery_load
-- What basic.deliver sends for rows the claim gave to AMQP consumers: only rows
-- still running (a purge or queue.delete may have taken one meanwhile).
-- Scalars rather than the jsonb documents: nothing to parse per message in the common
-- case (no x-death). Header and body by one probe of the body's key per row: a lateral
-- subquery that its LIMIT keeps from being flattened into a join (which statistics from a
-- drained table turned into a walk of the whole body index per row); two scalar
-- subqueries probed it twice, a quarter more of this statement's CPU. A small claim
-- returns the same columns (pepsi.amqp_claimed_delivery): change both, a test holds
-- them equal (test_amqp_rows_with_the_claim).
SELECT w.workqueue_id, w.properties ->> 'exchange', w.properties ->> 'routing_key',
       (w.state ->> 'delivery_count')::bigint, (w.state ->> 'redelivered')::boolean,
       w.state -> 'x_death', w.state -> 'x_first_death', extract(epoch FROM w.expires)::float8,
       b.header, b.body,
       -- a row that came from a stage of the pipeline, not over AMQP: its properties are built
       CASE WHEN NOT w.properties ? 'exchange' THEN
           jsonb_build_array(w.message_id, w.content_type, w.correlation_id, w.properties)
       END
FROM pepsi.workqueue w
LEFT JOIN LATERAL (
    SELECT x.header, x.body FROM pepsi.workqueue_body x WHERE x.body_id = w.body_id LIMIT 1
) b ON true
WHERE w.workqueue_id = ANY(%(ids)s::bigint[]) AND w.status = 'running';

-- name: amqp_get
-- basic.get: claim the queue's next pending row, its highest priority first, else its
-- oldest (skipping one the dispatcher's claim holds), and count what stays ready, in
-- one statement. Without priorities the first probe finds an empty index.
WITH first AS (
    SELECT workqueue_id FROM pepsi.workqueue
    WHERE stage = %(stage)s AND status = 'pending' AND priority > 0
    ORDER BY stage, priority DESC, workqueue_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), oldest AS (
    SELECT workqueue_id FROM pepsi.workqueue
    WHERE stage = %(stage)s AND status = 'pending' AND NOT EXISTS (SELECT 1 FROM first)
    ORDER BY stage, workqueue_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), next AS (
    SELECT workqueue_id FROM first UNION ALL SELECT workqueue_id FROM oldest
), got AS (
    UPDATE pepsi.workqueue w SET status = 'running'
    FROM next WHERE w.workqueue_id = next.workqueue_id
    RETURNING w.workqueue_id, w.properties, w.state, w.expires, w.body_id,
              w.message_id, w.content_type, w.correlation_id
)
SELECT got.workqueue_id, got.properties ->> 'exchange', got.properties ->> 'routing_key',
       (got.state ->> 'delivery_count')::bigint, (got.state ->> 'redelivered')::boolean,
       got.state -> 'x_death', got.state -> 'x_first_death',
       extract(epoch FROM got.expires)::float8,
       b.header, b.body,
       CASE WHEN NOT got.properties ? 'exchange' THEN
           jsonb_build_array(got.message_id, got.content_type, got.correlation_id, got.properties)
       END,
       (SELECT count(*) FROM pepsi.workqueue
        WHERE stage = %(stage)s AND status = 'pending') - 1 AS ready
FROM got
LEFT JOIN LATERAL (  -- one probe of the body's key, as in amqp_delivery_load
    SELECT x.header, x.body FROM pepsi.workqueue_body x WHERE x.body_id = got.body_id LIMIT 1
) b ON true;

-- name: amqp_settle
-- Consumers' outcomes, many per commit: acked rows are deleted; returned ones
-- (nack/reject with requeue, a closed channel) go back to pending at their place
-- with the redelivered mark and one more delivery; unsent ones (claimed for a
-- consumer that went away first) go back untouched. Only rows still running.
WITH acked AS (
    DELETE FROM pepsi.workqueue
    WHERE workqueue_id = ANY(%(acked)s::bigint[]) AND status = 'running'
    RETURNING 1
), returned AS (
    UPDATE pepsi.workqueue
    SET status = 'pending',
        state = state || jsonb_build_object(
            'redelivered', true,
            'delivery_count', coalesce((state ->> 'delivery_count')::bigint, 0) + 1)
    WHERE workqueue_id = ANY(%(returned)s::bigint[]) AND status = 'running'
    RETURNING 1
), unsent AS (
    UPDATE pepsi.workqueue SET status = 'pending'
    WHERE workqueue_id = ANY(%(unsent)s::bigint[]) AND status = 'running'
    RETURNING 1
)
SELECT (SELECT count(*) FROM acked), (SELECT count(*) FROM returned),
       (SELECT count(*) FROM unsent);

-- name: amqp_dead_letter
-- Dead-lettering (rejected without requeue, over the delivery limit, expired at
-- delivery): each running row is copied to the stages its queue's dead-letter
-- exchange routes it to (new rows, so they join those queues at the tail, sharing
-- the body), with the x-death history in state and the new exchange and routing
-- key in properties, and the original is deleted; a copy expires by its queue's
-- x-message-ttl from now (ttls, ms, aligned with stages; null: none), not by the
-- expiry it had (RabbitMQ removes the expiration property). A row routed nowhere (no
-- dead-letter exchange, or it routes to no queue) is kept as failed, with the
-- reason, where RabbitMQ would drop it: Pepsi loses nothing silently.
WITH d AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb)
        AS d(workqueue_id bigint, stages text[], ttls bigint[], state jsonb, properties jsonb,
             reason text)
), src AS (
    SELECT w.* FROM pepsi.workqueue w JOIN d USING (workqueue_id)
    WHERE w.status = 'running'
    FOR UPDATE OF w
), copies AS (
    INSERT INTO pepsi.workqueue (stage, message_id, sender, recipients, origin_user,
                                 origin_peer, header_from, subject, content_type,
                                 correlation_id, properties, state, body_id, expires)
    SELECT s.stage, src.message_id, src.sender, src.recipients, src.origin_user,
           src.origin_peer, src.header_from, src.subject, src.content_type,
           src.correlation_id, d.properties, d.state, src.body_id,
           now() + s.ttl * interval '1 millisecond'
    FROM src JOIN d USING (workqueue_id)
    CROSS JOIN LATERAL unnest(d.stages, d.ttls) WITH ORDINALITY AS s(stage, ttl, n)
    ORDER BY src.workqueue_id, s.n
    RETURNING 1
), moved AS (
    DELETE FROM pepsi.workqueue w USING d
    WHERE w.workqueue_id = d.workqueue_id AND w.status = 'running'
      AND cardinality(d.stages) > 0
    RETURNING 1
), failed AS (
    UPDATE pepsi.workqueue w
    SET status = 'failed', expires = NULL, timeout = NULL,
        state = d.state || jsonb_build_object(
            'last_error', 'dead-lettered: ' || d.reason,
            'failed_stage', w.stage,
            'failure_class', d.reason,
            'dead_letter_reason', d.reason)
    FROM d
    WHERE w.workqueue_id = d.workqueue_id AND w.status = 'running'
      AND cardinality(d.stages) = 0
    RETURNING 1
)
SELECT (SELECT count(*) FROM copies), (SELECT count(*) FROM moved),
       (SELECT count(*) FROM failed);

-- name: amqp_dead_letter_load
-- The rows about to be dead-lettered, locked until amqp_dead_letter has moved them.
SELECT w.workqueue_id, w.stage, w.properties, w.state,
       (SELECT b.header FROM pepsi.workqueue_body b WHERE b.body_id = w.body_id)
FROM pepsi.workqueue w
WHERE w.workqueue_id = ANY(%(ids)s::bigint[]) AND w.status = 'running'
FOR UPDATE OF w;

-- name: amqp_queue_transient
-- The queues that do not outlive a restart of the broker: non-durable, or exclusive.
SELECT vhost, name FROM pepsi.amqp_queue WHERE NOT durable OR exclusive ORDER BY vhost, name;

-- name: amqp_expiry_queues
-- The AMQP expiry service's pass (pepsi.amqp.broker.expiry): every vhost's queues, and how long
-- ago (ms, the database's clock) each was declared, for x-expires.
SELECT vhost, name, stage, durable, exclusive, auto_delete, arguments,
       (extract(epoch FROM now() - declared_at) * 1000)::bigint
FROM pepsi.amqp_queue;

-- name: amqp_expiry_claim
-- The expired pending rows of these stages (AMQP queues), oldest expiry first, at most
-- max_rows (workqueue_expires_idx), set to running in one statement, for the deliverer
-- to dead-letter (reason expired). A row the dispatcher's claim holds is skipped.
WITH due AS (
    SELECT workqueue_id FROM pepsi.workqueue
    WHERE status = 'pending' AND expires IS NOT NULL AND expires <= now()
      AND stage = ANY(%(stages)s::text[])
    ORDER BY expires
    LIMIT %(max_rows)s
    FOR UPDATE SKIP LOCKED
)
UPDATE pepsi.workqueue w SET status = 'running'
FROM due
WHERE w.workqueue_id = due.workqueue_id AND w.status = 'pending'
RETURNING w.workqueue_id, w.stage;

-- name: amqp_expiry_claim_overflowed
-- Rows x-overflow drop-head pushed out of these stages (AMQP queues with a dead-letter
-- exchange: the publish function left them failed, reason overflow), oldest first, at most
-- max_rows (workqueue_failed_idx), set to running for the deliverer to dead-letter.
WITH due AS (
    SELECT workqueue_id FROM pepsi.workqueue
    WHERE status = 'failed' AND stage = ANY(%(stages)s::text[])
      AND state ->> 'dead_letter_reason' = 'overflow'
    ORDER BY stage, workqueue_id
    LIMIT %(max_rows)s
    FOR UPDATE SKIP LOCKED
)
UPDATE pepsi.workqueue w SET status = 'running'
FROM due
WHERE w.workqueue_id = due.workqueue_id AND w.status = 'failed'
RETURNING w.workqueue_id, w.stage;

-- name: amqp_bytes_over
-- x-max-length-bytes (pepsi.amqp.broker.expiry): the newest max_scan pending rows of one stage
-- (an AMQP queue), newest first (workqueue_pending_idx, backwards), with a running sum of
-- their body octets; the newest row past max_bytes is the cut, and with drop the pending
-- rows up to it (oldest first, at most max_rows; a row the dispatcher's claim holds is
-- skipped) are set to running for the deliverer to dead-letter (reason maxlen). Returns
-- the rows scanned, their body octets, and the ids claimed.
WITH newest AS (
    SELECT workqueue_id, body_id FROM pepsi.workqueue
    WHERE stage = %(stage)s AND status = 'pending'
    ORDER BY workqueue_id DESC
    LIMIT %(max_scan)s
), summed AS (
    SELECT n.workqueue_id,
           sum(coalesce((SELECT octet_length(b.body) FROM pepsi.workqueue_body b
                         WHERE b.body_id = n.body_id), 0))
               OVER (ORDER BY n.workqueue_id DESC ROWS UNBOUNDED PRECEDING) AS total
    FROM newest n
), cut AS (
    SELECT max(workqueue_id) AS last FROM summed WHERE total > %(max_bytes)s
), due AS (
    SELECT w.workqueue_id FROM pepsi.workqueue w, cut
    WHERE %(drop)s AND w.stage = %(stage)s AND w.status = 'pending'
      AND w.workqueue_id <= cut.last
    ORDER BY w.workqueue_id
    LIMIT %(max_rows)s
    FOR UPDATE OF w SKIP LOCKED
), claimed AS (
    UPDATE pepsi.workqueue w SET status = 'running'
    FROM due
    WHERE w.workqueue_id = due.workqueue_id AND w.status = 'pending'
    RETURNING w.workqueue_id
)
SELECT (SELECT count(*) FROM newest), (SELECT coalesce(max(total), 0) FROM summed),
       ARRAY(SELECT workqueue_id FROM claimed ORDER BY workqueue_id);

-- name: live_notify
-- The dispatcher's live snapshot (pepsi.dispatch.services.live): its parts, one notification each,
-- sent by one statement so that they arrive together. No table is written.
SELECT pg_notify('pepsi_live', part) FROM unnest(%(payloads)s::text[]) AS part;

-- name: live_listen
-- Readers of the live snapshot (pepsi.admin.watch.live_listener: pepsi top, the web console).
LISTEN pepsi_live;

-- name: workqueue_page_pending
-- One page of a stage's pending rows (admin/queue.py list_messages, the web console's
-- stage page), after a workqueue_id: workqueue_pending_idx in order, no sort, no offset.
-- The stage is bounded as a range, not an equality, and the order names it: then only
-- the (stage, workqueue_id) index gives the order, and the planner cannot walk the
-- primary key filtering (fine on average, a scan of the table when the stage's rows
-- sit at its far end).
SELECT workqueue_id, stage, status::text, arrived, timeout, sender_key, message_id,
       state->>'last_error', coalesce((state->>'strikes')::int, 0)
FROM pepsi.workqueue
WHERE status = 'pending'
  AND (stage, workqueue_id) > (%(stage)s::text, %(after)s::bigint) AND stage <= %(stage)s
  AND (%(sender_key)s::text IS NULL OR sender_key = %(sender_key)s)
  AND (%(failure_class)s::text IS NULL OR state->>'failure_class' = %(failure_class)s)
  AND (%(older_than)s::float8 IS NULL
       OR arrived <= now() - make_interval(secs => %(older_than)s::float8))
ORDER BY stage, workqueue_id
LIMIT %(limit)s;

-- name: workqueue_page_failed
-- As workqueue_page_pending for failed and timeout rows (status: one of them, or NULL
-- for both), along workqueue_failed_idx.
SELECT workqueue_id, stage, status::text, arrived, timeout, sender_key, message_id,
       state->>'last_error', coalesce((state->>'strikes')::int, 0)
FROM pepsi.workqueue
WHERE status IN ('failed', 'timeout')
  AND (%(status)s::text IS NULL OR status::text = %(status)s)
  AND (stage, workqueue_id) > (%(stage)s::text, %(after)s::bigint) AND stage <= %(stage)s
  AND (%(sender_key)s::text IS NULL OR sender_key = %(sender_key)s)
  AND (%(failure_class)s::text IS NULL OR state->>'failure_class' = %(failure_class)s)
  AND (%(older_than)s::float8 IS NULL
       OR arrived <= now() - make_interval(secs => %(older_than)s::float8))
ORDER BY stage, workqueue_id
LIMIT %(limit)s;

-- name: workqueue_page_any
-- One page of any rows (any stage, any status), after a workqueue_id, in the primary
-- key's order: paused and running rows are few; a listing of every status walks the key.
SELECT workqueue_id, stage, status::text, arrived, timeout, sender_key, message_id,
       state->>'last_error', coalesce((state->>'strikes')::int, 0)
FROM pepsi.workqueue
WHERE (%(stage)s::text IS NULL OR stage = %(stage)s)
  AND (%(status)s::text IS NULL OR status::text = %(status)s)
  AND workqueue_id > %(after)s::bigint
  AND (%(sender_key)s::text IS NULL OR sender_key = %(sender_key)s)
  AND (%(failure_class)s::text IS NULL OR state->>'failure_class' = %(failure_class)s)
  AND (%(older_than)s::float8 IS NULL
       OR arrived <= now() - make_interval(secs => %(older_than)s::float8))
ORDER BY workqueue_id
LIMIT %(limit)s;

-- name: web_select_matching
-- The ids a repair from the web console applies to: as workqueue_select_matching, narrowed
-- by the stage page's filters (sender key, rows older than some seconds).
SELECT workqueue_id, status::text FROM pepsi.workqueue
WHERE (cardinality(%(ids)s::bigint[]) = 0 OR workqueue_id = ANY(%(ids)s::bigint[]))
  AND (%(stage)s::text IS NULL OR stage = %(stage)s
       OR state->>'failed_stage' = %(stage)s)
  AND (%(failure_class)s::text IS NULL OR state->>'failure_class' = %(failure_class)s)
  AND (%(sender_key)s::text IS NULL OR sender_key = %(sender_key)s)
  AND (%(older_than)s::float8 IS NULL
       OR arrived <= now() - make_interval(secs => %(older_than)s::float8))
  AND status = ANY(%(statuses)s::pepsi.workqueue_status[])
ORDER BY workqueue_id;

-- name: web_message_head
-- The first bytes of one message's header and body (the web console shows no more).
SELECT substring(b.header FROM 1 FOR %(limit)s), substring(b.body FROM 1 FOR %(limit)s)
FROM pepsi.workqueue w LEFT JOIN pepsi.workqueue_body b USING (body_id)
WHERE w.workqueue_id = %(id)s;

-- name: web_overview_oldest_pending
-- The web console's overview: per stage, the oldest pending row's age and id. One probe
-- of workqueue_pending_idx (stage, workqueue_id) WHERE status = 'pending' per stage:
-- the oldest id is the head of the stage's range, so the backlog is never scanned.
-- The stage is bounded (>= and <=) rather than equal on purpose: with `=` the planner
-- takes the stage as constant, drops it from the order and may walk the primary key
-- instead, filtering every row of the table when the stage has none pending.
SELECT s.stage, extract(epoch FROM now() - h.arrived)::float8 AS age_s, h.workqueue_id
FROM unnest(%(stages)s::text[]) AS s(stage)
CROSS JOIN LATERAL (
    SELECT q.arrived, q.workqueue_id FROM pepsi.workqueue q
    WHERE q.stage >= s.stage AND q.stage <= s.stage AND q.status = 'pending'
    ORDER BY q.stage, q.workqueue_id
    LIMIT 1
) h;

-- name: web_overview_chart
-- The web console's chart: the last day's counts (pepsi.stage_stats_minute, which the
-- dispatcher's statistics flushes write) per bar of %(minutes)s minutes and stage, bars
-- starting on multiples of it since midnight UTC. The server's clock comes along.
SELECT now(), b.start, b.stage, b.processed, b.failed
FROM (SELECT 1) AS one
LEFT JOIN (
    SELECT date_bin(make_interval(mins => %(minutes)s), minute, TIMESTAMPTZ '2000-01-01 UTC')
               AS start,
           stage, sum(processed)::bigint AS processed, sum(failed)::bigint AS failed
    FROM pepsi.stage_stats_minute
    WHERE minute > now() - interval '1 day'
    GROUP BY 1, 2
) AS b ON true
ORDER BY b.start, b.stage;

-- name: web_overview_amqp_queues
-- The web console's stage graph: declared AMQP queues (their stage names), the first
-- few by name, and how many there are in all.
SELECT q.stage, count(*) OVER () FROM pepsi.amqp_queue q ORDER BY q.stage LIMIT %(limit)s;

-- name: workqueue_page_in_order
-- Before a workqueue_page_* query, in its transaction: take the rows in the index's
-- order, never gathered and sorted. A filter the planner misjudges (a failure class,
-- an age: it expects few rows) would otherwise have it sort every row of a large stage
-- past the page's start; in order, a page reads the stage's index from that id until
-- the page is full.
SET LOCAL enable_sort = off;

-- name: workqueue_record_outcome_tx
-- Issue 18: a transactional stage's outcome, in the transaction that holds the
-- stage's writes: one row, guarded by the claim token as well as status and
-- stage (see pepsi.workqueue_record_outcome); false: the row was handed to
-- someone else meanwhile, and the worker rolls back.
SELECT pepsi.workqueue_record_outcome(%(id)s, %(stage)s, %(token)s, %(outcome)s,
                                      %(next_stage)s, %(until)s, NULL, %(state)s::jsonb);

-- name: workqueue_claim_tokens
-- Issue 18: the claim tokens of rows this worker just split (W-9), read in the
-- split's transaction: the split updated them, so their xmin is the split's.
SELECT workqueue_id, xmin::text FROM pepsi.workqueue
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND status = 'running' AND stage = %(stage)s;

-- name: amqp_outcomes_async_commit
-- The consumers' outcomes connection: an ack lost with a crash is a redelivery, which
-- at-least-once allows (no client waits on it), so no commit waits for the disk.
SET synchronous_commit = off;

-- name: mail_user_insert
INSERT INTO pepsi.mail_user (name, password_hash)
VALUES (%(name)s, %(password_hash)s)
ON CONFLICT (name) DO NOTHING
RETURNING name, created, updated;

-- name: mail_user_get
-- The ingress's AUTH: the stored hash of one user (no row: no such user; `mail user passwd` asks first).
SELECT password_hash FROM pepsi.mail_user WHERE name = %(name)s;

-- name: mail_user_list
SELECT name, created, updated FROM pepsi.mail_user ORDER BY name;

-- name: mail_user_delete
DELETE FROM pepsi.mail_user WHERE name = %(name)s RETURNING name;

-- name: mail_user_set_password
UPDATE pepsi.mail_user SET password_hash = %(password_hash)s, updated = now()
WHERE name = %(name)s
RETURNING name;

-- name: workqueue_record_outcomes_edited
-- workqueue_record_outcomes for a batch where a stage changed its messages
-- (issue 32): each update's `edits` names the columns it sets (a column it
-- does not name keeps its value), and a row whose header block or body was
-- replaced gets a new body row (NULL: that part as stored), so that rows split
-- from the same message keep theirs. The old body goes with its last row
-- (the trigger workqueue_body_release).
WITH finished AS (
    DELETE FROM pepsi.workqueue w
    WHERE w.workqueue_id = ANY(%(finished)s::bigint[])
      AND w.status = 'running' AND w.stage = %(stage)s
    RETURNING 1
), content AS (
    SELECT c.workqueue_id, c.header, c.body,
           nextval('pepsi.workqueue_body_body_id_seq') AS new_body_id
    FROM unnest(%(content_ids)s::bigint[], %(headers)s::bytea[], %(bodies)s::bytea[])
         AS c(workqueue_id, header, body)
), stored AS (
    INSERT INTO pepsi.workqueue_body (body_id, header, body) OVERRIDING SYSTEM VALUE
    SELECT c.new_body_id, coalesce(c.header, b.header), coalesce(c.body, b.body)
    FROM content c
    JOIN pepsi.workqueue w ON w.workqueue_id = c.workqueue_id
                          AND w.status = 'running' AND w.stage = %(stage)s
    LEFT JOIN pepsi.workqueue_body b ON b.body_id = w.body_id
    RETURNING body_id
)
UPDATE pepsi.workqueue w
SET stage = r.stage, status = r.status, timeout = r.timeout, state = r.state,
    message_id = CASE WHEN r.edits ? 'message_id' THEN r.edits ->> 'message_id'
                      ELSE w.message_id END,
    sender = CASE WHEN r.edits ? 'sender' THEN r.edits ->> 'sender' ELSE w.sender END,
    recipients = CASE WHEN r.edits ? 'recipients'
                      THEN ARRAY(SELECT jsonb_array_elements_text(r.edits -> 'recipients'))
                      ELSE w.recipients END,
    header_from = CASE WHEN r.edits ? 'header_from' THEN r.edits ->> 'header_from'
                       ELSE w.header_from END,
    subject = CASE WHEN r.edits ? 'subject' THEN r.edits ->> 'subject' ELSE w.subject END,
    content_type = CASE WHEN r.edits ? 'content_type' THEN r.edits ->> 'content_type'
                        ELSE w.content_type END,
    correlation_id = CASE WHEN r.edits ? 'correlation_id' THEN r.edits ->> 'correlation_id'
                          ELSE w.correlation_id END,
    properties = CASE WHEN r.edits ? 'properties' THEN r.edits -> 'properties'
                      ELSE w.properties END,
    body_id = coalesce((SELECT c.new_body_id FROM content c
                        WHERE c.workqueue_id = w.workqueue_id
                          AND EXISTS (SELECT 1 FROM stored s WHERE s.body_id = c.new_body_id)),
                       w.body_id)
FROM jsonb_to_recordset(%(updates)s::jsonb)
     AS r(workqueue_id bigint, stage text, status pepsi.workqueue_status,
          timeout timestamptz, state jsonb, edits jsonb)
WHERE w.workqueue_id = ANY(ARRAY(SELECT (e ->> 'workqueue_id')::bigint
                                 FROM jsonb_array_elements(%(updates)s::jsonb) e))
  AND w.workqueue_id = r.workqueue_id AND w.status = 'running' AND w.stage = %(stage)s;

-- name: workqueue_record_split
-- Issue 32: one message's split outcome and the messages it makes (see
-- pepsi.workqueue_record_split); the new rows' ids, or NULL if nothing was written.
-- Its clones and new messages (delivery status notifications) may be pending: a
-- NOTIFY at the commit wakes the dispatcher for them, as for a publish (the
-- worker's answer names only the row's own outcome: finish, pause).
SELECT pepsi.workqueue_record_split(
    %(id)s, %(stage)s, %(parts)s::jsonb, %(spawn)s::jsonb, %(spawn_headers)s::bytea[],
    %(spawn_bodies)s::bytea[], %(edits)s::jsonb, %(header)s::bytea, %(body)s::bytea, %(token)s)
FROM pg_notify('workqueue', '') AS notify;

-- name: workqueue_started_by_stage
-- `pepsi queue`: how many of the messages workers have started (the dispatcher's live
-- snapshot names them) are running, per stage; one probe of the primary key each.
SELECT stage, count(*) FROM pepsi.workqueue
WHERE workqueue_id = ANY(%(ids)s::bigint[]) AND status = 'running'
GROUP BY stage;
