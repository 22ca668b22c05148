-- 0021: the stages the running dispatcher serves (issue 33), written at its start and
-- at each reload, so that `pepsi top`, `pepsi queue status`, the web console and a
-- publisher can name the stages where messages wait that it does not serve.
ALTER TABLE pepsi.dispatch_stats ADD COLUMN serves text[];
