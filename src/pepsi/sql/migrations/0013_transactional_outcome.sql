-- 0013: record a message's outcome inside the stage's own transaction (issue 18).
--
-- A worker that writes its effects to this database and its outcome in the
-- same transaction runs each message exactly once. The claim token is the
-- row's xmin as the worker loaded it: every claim, requeue, reset or strike
-- of a row is an UPDATE, so a row handed to another worker meanwhile (a
-- restarted dispatcher reset it, a dead worker's ids were requeued) has
-- another xmin, and this write touches nothing: false, roll back.

CREATE FUNCTION pepsi.workqueue_claim_token(id bigint, stage text)
RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT w.xmin::text FROM pepsi.workqueue w
    WHERE w.workqueue_id = id AND w.status = 'running' AND w.stage = workqueue_claim_token.stage;
$$;

CREATE FUNCTION pepsi.workqueue_record_outcome(
    id bigint, stage text, token text, outcome text,
    next_stage text DEFAULT NULL, until timestamptz DEFAULT NULL,
    reason text DEFAULT NULL, state jsonb DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    touched integer;
BEGIN
    IF outcome = 'finish' THEN
        DELETE FROM pepsi.workqueue w
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'advance' THEN
        IF next_stage IS NULL THEN
            RAISE EXCEPTION 'advance needs a next_stage' USING ERRCODE = '22023';
        END IF;
        UPDATE pepsi.workqueue w
        SET stage = next_stage, status = 'pending', timeout = NULL,
            state = coalesce(workqueue_record_outcome.state,
                             CASE WHEN next_stage = w.stage THEN w.state
                                  ELSE w.state - 'strikes' - 'temporary_failures' END)
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'pause' THEN
        UPDATE pepsi.workqueue w
        SET status = 'paused', timeout = coalesce(until, now()),
            state = coalesce(workqueue_record_outcome.state,
                             CASE WHEN reason IS NULL THEN w.state
                                  ELSE w.state || jsonb_build_object('pause_reason', reason) END)
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSIF outcome = 'fail' THEN
        UPDATE pepsi.workqueue w
        SET status = 'failed', timeout = NULL,
            state = coalesce(workqueue_record_outcome.state,
                             w.state || jsonb_build_object(
                                 'failed_stage', w.stage, 'failure_class', 'permanent',
                                 'last_error', coalesce(reason, 'permanent')))
        WHERE w.workqueue_id = id AND w.status = 'running'
          AND w.stage = workqueue_record_outcome.stage AND w.xmin::text = token;
    ELSE
        RAISE EXCEPTION 'unknown outcome %, expected advance, finish, pause or fail', outcome
            USING ERRCODE = '22023';
    END IF;
    GET DIAGNOSTICS touched = ROW_COUNT;
    RETURN touched = 1;
END;
$$;
