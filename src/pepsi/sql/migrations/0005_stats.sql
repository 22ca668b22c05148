-- 0005: outcome, wakeup and back-pressure counters (P-9).

-- Per stage, from the outcome a worker names in its status-line report
-- (a program that names none is counted only in `processed`), and from the
-- dispatcher's own view of hangs.
ALTER TABLE pepsi.stage_stats
    ADD COLUMN finished    bigint NOT NULL DEFAULT 0,   -- row deleted: the pipeline's end
    ADD COLUMN advanced    bigint NOT NULL DEFAULT 0,   -- moved on to another stage
    ADD COLUMN paused      bigint NOT NULL DEFAULT 0,   -- paused by the stage itself
    ADD COLUMN retries     bigint NOT NULL DEFAULT 0,   -- paused after a host failure
    ADD COLUMN timed_out   bigint NOT NULL DEFAULT 0;   -- killed past MAX_RUNTIME

ALTER TABLE pepsi.dispatch_stats
    ADD COLUMN wakeups_notify      bigint NOT NULL DEFAULT 0,   -- NOTIFY workqueue
    ADD COLUMN wakeups_worker      bigint NOT NULL DEFAULT 0,   -- a worker answered, started or exited
    ADD COLUMN wakeups_poll        bigint NOT NULL DEFAULT 0,   -- the POLL_INTERVAL heartbeat
    ADD COLUMN wakeups_timer       bigint NOT NULL DEFAULT 0,   -- a deadline: paused row due, MAX_RUNTIME, idle worker
    ADD COLUMN workers_retired     bigint NOT NULL DEFAULT 0,   -- stopped on purpose: idle, recycled, shutdown
    ADD COLUMN backpressure_events bigint NOT NULL DEFAULT 0;   -- 75 answers: a stage's cap halved
