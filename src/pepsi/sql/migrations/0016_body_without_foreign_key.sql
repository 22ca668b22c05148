-- 0016: workqueue.body_id loses its foreign key to workqueue_body.
--
-- Measured on PostgreSQL 18 (backend CPU per row, bench/amqp.py's 1 KB messages):
-- the key's checks cost about 5 µs of a published row's 17 to 24 (the insert
-- checks the body) and 6 of an acknowledged row's 11 to 16 (deleting the body
-- checks that no row refers to it).
--
-- What the key guarded still holds by construction (docs/database.md,
-- workqueue_body): a body is written in the same statement as the rows that first
-- refer to it; a later row refers to an existing body only as a copy of a row its
-- transaction holds locked (workqueue_split, amqp_dead_letter), which therefore
-- cannot be deleted meanwhile; and a body is deleted only when, in a snapshot taken
-- after locking it, no row refers to it (the release trigger, the sweep).

ALTER TABLE pepsi.workqueue DROP CONSTRAINT workqueue_body_id_fkey;
