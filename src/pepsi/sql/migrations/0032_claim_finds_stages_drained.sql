-- 0032: a claim says which stages it left without a pending row (issue 36). A
-- message on an idle pipeline cost two claims: the one that took it, and an empty
-- one after its worker's answer (a claim that took rows said nothing of the rest).
-- At 500 single publishes a second that was 7 938 claims for 4 301 messages.
-- After a claim, in its statement: which of `found` (the stages it took rows of)
-- that are among `for_stages` have no pending row left. VOLATILE: a snapshot of
-- its own, taken after the claim, so a row committed meanwhile counts; a row
-- committed later NOTIFYs, and that news outlasts this answer
-- (dispatch/policy/known_empty.py). One probe of the pending index per stage.
CREATE FUNCTION pepsi.workqueue_stages_drained(found text[], for_stages text[])
RETURNS text[]
LANGUAGE sql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT coalesce(array_agg(s.stage), '{}')
    FROM (SELECT DISTINCT f.stage FROM unnest(found) AS f(stage)
          WHERE f.stage = ANY(for_stages)) s
    WHERE NOT EXISTS (SELECT 1 FROM pepsi.workqueue q
                      WHERE q.stage = s.stage AND q.status = 'pending')
$$;
