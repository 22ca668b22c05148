-- The roles of least privilege (`pepsi setup roles`; docs/security.md). Group roles,
-- without login: an operator makes login roles members of them. Roles belong to the
-- server, privileges to each database: `roles_create` once per server (again is
-- harmless), `roles_grant` in each Pepsi database, again after each schema upgrade
-- (`pepsi setup schema` does it when the roles exist).

-- name: roles_exist
SELECT count(*) = 2 FROM pg_roles WHERE rolname IN ('pepsi_publisher', 'pepsi_worker');

-- name: roles_create
-- pepsi_publisher: publishes (the publish functions run as the owner), reads the
-- configuration overlay and which stages the dispatcher serves; nothing else.
-- pepsi_worker: stage code; what a publisher may, and its rows' life at a stage.
-- Two installers at once: the loser's CREATE fails with duplicate_object or
-- unique_violation, which is what it wanted anyway.
DO $$
BEGIN
    BEGIN
        CREATE ROLE pepsi_publisher NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
    BEGIN
        CREATE ROLE pepsi_worker NOLOGIN IN ROLE pepsi_publisher;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
END
$$;

-- name: roles_grant
-- Everything either may do in this database, and nothing else: the owner keeps the
-- overlay's writes (a PROGRAM is a program the dispatcher runs), the AMQP and mail
-- users' password hashes, the dead letters, the statistics and the repairs.
REVOKE ALL ON ALL TABLES IN SCHEMA pepsi FROM pepsi_publisher, pepsi_worker;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pepsi FROM pepsi_publisher, pepsi_worker;
GRANT USAGE ON SCHEMA pepsi TO pepsi_publisher, pepsi_worker;
GRANT SELECT ON pepsi.schema_version, pepsi.config_override, pepsi.dispatch_stats
    TO pepsi_publisher;
GRANT EXECUTE ON FUNCTION pepsi.workqueue_publish, pepsi.workqueue_publish_plain,
    pepsi.workqueue_publish_one TO pepsi_publisher;
GRANT SELECT, INSERT, UPDATE, DELETE ON pepsi.workqueue, pepsi.workqueue_body
    TO pepsi_worker;
GRANT SELECT ON pepsi.settings TO pepsi_worker;
GRANT USAGE ON SEQUENCE pepsi.workqueue_workqueue_id_seq, pepsi.workqueue_body_body_id_seq
    TO pepsi_worker;
