-- 0033: the FIFO claim (FAIR_SCHEDULING = no) keeps one generic plan (issue 36).
-- Without it the plan cache planned the function's UPDATE afresh for most calls
-- (a custom plan looked cheaper than the generic one under the function's
-- enable_* settings, as the fair claim's ids did before 0026): an idle claim of
-- one row took 1.6 ms after 20 ms idle and 0.54-0.76 back to back, against 1.1
-- and 0.26-0.36 for the fair claim; 1.1 and 0.38 with the generic plan. Its
-- only plan is the one these settings leave (each stage's pending index, the
-- primary key for the update), whatever the statistics.
ALTER FUNCTION pepsi.workqueue_claim_fifo(text[], integer[])
    SET plan_cache_mode = force_generic_plan;
