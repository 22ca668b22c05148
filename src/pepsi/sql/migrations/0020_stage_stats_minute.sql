-- 0020: the throughput chart's history, kept in the database (issue 33).
--
-- The throughput chart's history (the web console): per minute and stage, what
-- the dispatcher's statistics flushes counted (status 0 reports, others), so
-- that the chart shows the last day after a restart, not only what one
-- console process has seen. Written by the flush (stats_flush), which also
-- deletes what is older than a day: at most 1 440 rows per stage.
CREATE TABLE pepsi.stage_stats_minute (
    minute     timestamptz NOT NULL,   -- the flush's minute
    stage      text NOT NULL,
    processed  bigint NOT NULL DEFAULT 0,
    failed     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, stage)
);
