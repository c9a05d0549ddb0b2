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

-- Every span, raw: step and phase spans plus one per collective.
CREATE OR REPLACE VIEW spans AS
SELECT * FROM span_records
UNION ALL BY NAME
SELECT run_id, rank, step, span_id, parent_span_id, 'ranktrace.collective' AS name, op, axis,
       group_id, group_size, seq, peer, bytes, dtype, start_ns, end_ns
FROM collectives;
