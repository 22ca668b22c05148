-- 0029: the fair claim keeps one generic plan of each of its statements. Its
-- statements take the stage, the caps and the sender window as parameters, and
-- PostgreSQL planned them afresh on every call (a custom plan looked cheaper than a
-- generic one): a claim of 4 rows from one sender cost the server 228 µs, 182 µs
-- with generic plans; a claim of a stage with no pending row 117 µs, 75 µs. The
-- plans stay index probes whatever the statistics (scans and sorts already off for
-- the function; tests/integration/test_claim_plan.py and test_claim_fair.py).
ALTER FUNCTION pepsi.workqueue_claim_fair SET plan_cache_mode = force_generic_plan;
