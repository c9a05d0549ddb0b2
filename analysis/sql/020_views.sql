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

-- Per (run, rank, step): where this rank's time went, for straggler diagnosis.
-- own_s: time not spent waiting for peers (step - blocking; on untraced steps, step minus
-- the waiting phases). host_s: time outside every phase (the trainer runs every collective
-- inside a phase, so this is the host: pauses, GC, scheduling). work_s: compute, i.e. phases
-- minus data loading minus all communication.
CREATE OR REPLACE VIEW step_breakdown AS
WITH axis_comm AS (
    SELECT run_id, rank, step,
           sum(transfer_s) FILTER (WHERE axis = 'tp') AS tp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'pp') AS pp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'dp') AS dp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'world') AS world_transfer_s,
           sum(blocking_s) FILTER (WHERE axis = 'tp') AS tp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'pp') AS pp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'dp') AS dp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'world') AS world_blocking_s
    FROM collectives
    GROUP BY ALL
),
phased AS (
    SELECT s.*,
           s.data_s + s.forward_s + s.backward_s + s.pipeline_wait_s + s.grad_sync_s
               + s.optimizer_s + coalesce(s.checkpoint_s, 0) AS phases_s
    FROM steps s
),
final AS (
    SELECT p.run_id, p.rank, p.pp, p.dp, p.tp, p.host, p.step, p.step_time_s, p.data_s,
           p.forward_s, p.backward_s, p.pipeline_wait_s, p.grad_sync_s, p.optimizer_s,
           p.checkpoint_s, p.comm_s, p.comm_transfer_s, p.comm_blocking_s, p.mfu, p.tokens,
           coalesce(p.compute_s, p.step_time_s - p.pipeline_wait_s - p.grad_sync_s) AS own_s,
           greatest(0, p.step_time_s - p.phases_s) AS host_s,
           greatest(0, p.phases_s - p.data_s
               - coalesce(p.comm_transfer_s + p.comm_blocking_s, p.comm_s, 0)) AS work_s,
           a.* EXCLUDE (run_id, rank, step)
    FROM phased p LEFT JOIN axis_comm a USING (run_id, rank, step)
)
SELECT * FROM final;

-- Per (run, axis, group, step): the transfer time of one collective group (a point-to-point
-- pair counts as a group of two), the median over its members, with the members.
CREATE OR REPLACE VIEW group_transfers AS
WITH per_member AS (
    SELECT run_id, axis, group_id,
           CASE WHEN peer >= 0 THEN least(rank, peer) ELSE -1 END AS pair_low,
           CASE WHEN peer >= 0 THEN greatest(rank, peer) ELSE -1 END AS pair_high,
           rank, step, sum(transfer_s) AS transfer_s, count(*) AS calls
    FROM collectives
    WHERE axis <> 'world'
    GROUP BY ALL
),
final AS (
    SELECT run_id, axis, group_id, pair_low, pair_high, step,
           median(transfer_s) AS transfer_s, max(calls) AS calls,
           list(rank ORDER BY rank) AS members
    FROM per_member
    GROUP BY ALL
)
SELECT * FROM final;
