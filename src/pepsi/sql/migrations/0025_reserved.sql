-- 0025: reserved for the publish functions of issue 36 (another branch). This
-- placeholder keeps the numbering contiguous on this branch and changes nothing;
-- the other branch's 0025 replaces it when both are merged.
SELECT 1;
