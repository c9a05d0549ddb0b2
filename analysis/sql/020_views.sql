-- Analysis views over the stored tables (created in the store by ingest).

-- Per (run, step): how the slowest rank compares with the median one.
CREATE OR REPLACE VIEW step_stats AS
WITH final AS (
    SELECT run_id, step,
           count(*) AS ranks,
           max(step_time_s) AS max_step_time_s,
           median(step_time_s) AS median_step_time_s,
           arg_max(rank, step_time_s) AS slowest_rank,
           max(compute_s) AS max_compute_s,
           arg_max(rank, compute_s) AS max_compute_rank,
           avg(mfu) AS mfu,
           any_value(loss) AS loss
    FROM steps
    GROUP BY run_id, step
)
SELECT * FROM final;
