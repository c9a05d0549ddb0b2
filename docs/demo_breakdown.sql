SELECT rank, pp, dp, tp,
       round(avg(step_time_s), 3) AS step_s,
       round(avg(forward_s + backward_s), 3) AS compute_s,
       round(avg(pipeline_wait_s), 3) AS pipeline_wait_s,
       round(avg(grad_sync_s), 3) AS grad_sync_s,
       round(avg(comm_blocking_s), 3) AS blocking_s,
       round(avg(mfu), 4) AS mfu
FROM steps
WHERE run_id = (SELECT run_id FROM runs WHERE name = 'demo' ORDER BY started_at DESC LIMIT 1)
  AND step > 0
GROUP BY ALL
ORDER BY rank
