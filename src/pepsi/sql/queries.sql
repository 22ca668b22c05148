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
SELECT stage, status::text AS status, count(*) AS messages
FROM pepsi.workqueue
GROUP BY stage, status
ORDER BY stage, status;

-- name: workqueue_body_gc
SELECT deleted, last_examined FROM pepsi.workqueue_body_gc(%(after_id)s, %(max_examined)s);
