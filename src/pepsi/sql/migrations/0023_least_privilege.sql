-- 0023: least privilege (issue 34). Publishing runs as the schema's owner, so that a
-- role allowed to publish (`pepsi setup roles`: pepsi_publisher) needs no privilege on
-- the tables: it cannot read others' messages, nor touch the configuration overlay.
-- search_path is fixed so that the caller's cannot change what the names mean.
ALTER FUNCTION pepsi.workqueue_publish SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_publish_plain SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION pepsi.workqueue_publish_one SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION pepsi.workqueue_publish, pepsi.workqueue_publish_plain,
    pepsi.workqueue_publish_one FROM PUBLIC;
