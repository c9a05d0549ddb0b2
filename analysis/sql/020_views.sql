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
-- the waiting phases). host_s: time outside every phase and every collective (the host:
-- pauses, GC, scheduling, a framework's own loop; a collective a framework runs between its
-- phases is communication, comm_outside_phases_s, NULL in stores from before it), less
-- ranktrace's own time in the step (ranktrace_s: a healthy Lightning job's rank 1 spent 3.8
-- and 6.4 ms of 12 ms steps in ranktrace's hand-over to its sink beside another job, and was
-- named a host pause). work_s:
-- compute, i.e. phases minus data loading minus the communication inside them. work_cpu_s:
-- the main thread's CPU time in those phases, work_core_wait_s the time it waited for a core
-- in their compute: the phases' wait less the wait inside their communication calls, where
-- recorded (as work_s leaves the calls out); NULL where not recorded.
CREATE OR REPLACE VIEW step_breakdown AS
WITH phased AS (
    SELECT *,
           data_s + forward_s + backward_s + pipeline_wait_s + grad_sync_s + optimizer_s
               + coalesce(checkpoint_s, 0) AS phases_s,
           forward_core_wait_s + backward_core_wait_s + pipeline_wait_core_wait_s
               + grad_sync_core_wait_s + optimizer_core_wait_s
               + coalesce(checkpoint_core_wait_s, 0) AS phases_core_wait_s
    FROM steps
),
final AS (
    SELECT run_id, rank, pp, dp, tp, host, step, step_time_s, data_s, forward_s, backward_s,
           pipeline_wait_s, grad_sync_s, optimizer_s, checkpoint_s, comm_s, comm_outside_phases_s,
           comm_transfer_s, comm_blocking_s, comm_core_wait_s, mfu, tokens, ranktrace_s,
           coalesce(compute_s, step_time_s - pipeline_wait_s - grad_sync_s) AS own_s,
           greatest(0, step_time_s - phases_s - coalesce(comm_outside_phases_s, 0)
               - coalesce(ranktrace_s, 0)) AS host_s,
           greatest(0, phases_s - data_s
               - (coalesce(comm_transfer_s + comm_blocking_s, comm_s, 0)
                  - coalesce(comm_outside_phases_s, 0))) AS work_s,
           forward_cpu_s + backward_cpu_s + pipeline_wait_cpu_s + grad_sync_cpu_s
               + optimizer_cpu_s + coalesce(checkpoint_cpu_s, 0) AS work_cpu_s,
           -- (least, like greatest, skips a NULL: an unknown wait stays NULL)
           phases_core_wait_s - least(phases_core_wait_s, coalesce(comm_core_wait_s, 0))
               AS work_core_wait_s,
           tp_transfer_s, pp_transfer_s, dp_transfer_s, world_transfer_s,
           tp_blocking_s, pp_blocking_s, dp_blocking_s, world_blocking_s
    FROM phased
)
SELECT * FROM final;
