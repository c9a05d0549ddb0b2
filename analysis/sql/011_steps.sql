-- Needs derived_* of 010_derived.sql and a relation run_collectives (see there).

-- The per-(run, rank, step) summary: raw step row plus its communication split.
-- compute_s = step time - blocking (time this rank was not waiting for others); known on
-- traced steps (collectives recorded one by one), NULL elsewhere.
CREATE OR REPLACE TEMP VIEW derived_steps AS
WITH comm AS (
    SELECT run_id, rank, step, sum(transfer_s) AS comm_transfer_s,
           sum(blocking_s) AS comm_blocking_s,
           sum(transfer_s) FILTER (WHERE axis = 'tp') AS tp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'pp') AS pp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'dp') AS dp_transfer_s,
           sum(transfer_s) FILTER (WHERE axis = 'world') AS world_transfer_s,
           sum(blocking_s) FILTER (WHERE axis = 'tp') AS tp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'pp') AS pp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'dp') AS dp_blocking_s,
           sum(blocking_s) FILTER (WHERE axis = 'world') AS world_blocking_s,
           -- the main thread's wait for a core inside the calls (async work: in its waits);
           -- NULL unless every call of the step has it
           CASE WHEN count(core_wait_end_ns - core_wait_start_ns) = count(*) THEN
               sum(core_wait_end_ns - core_wait_start_ns) / 1e9 END AS comm_core_wait_s
    FROM run_collectives
    GROUP BY ALL
),
final AS (
    SELECT s.*, c.* EXCLUDE (run_id, rank, step),
           s.step_time_s - c.comm_blocking_s AS compute_s,
           coalesce(s.gpu_max_allocated_bytes, s.mem_rss_peak_bytes) AS mem_peak_bytes
    FROM cur_steps s LEFT JOIN comm c USING (run_id, rank, step)
)
SELECT * FROM final;

-- Per (run, axis, group, step): the transfer time of one collective group (a point-to-point
-- pair counts as a group of two), the median over its members, with the members.
CREATE OR REPLACE TEMP VIEW derived_group_transfers AS
WITH per_member AS (
    SELECT run_id, axis, group_id,
           CASE WHEN peer >= 0 THEN least(rank, peer) ELSE -1 END AS pair_low,
           CASE WHEN peer >= 0 THEN greatest(rank, peer) ELSE -1 END AS pair_high,
           rank, step, sum(transfer_s) AS transfer_s, count(*) AS calls,
           -- less the main thread's wait for a core in each call, at most its transfer: a
           -- CPU rank descheduled inside a call stretches its transfer, not the link (blocked
           -- on a late peer, it sleeps: no wait for a core accrues there)
           sum(transfer_s - least(transfer_s, coalesce(
               greatest(0, core_wait_end_ns - core_wait_start_ns) / 1e9, 0))) AS transfer_net_s
    FROM run_collectives
    WHERE axis <> 'world'
    GROUP BY ALL
),
final AS (
    SELECT run_id, axis, group_id, pair_low, pair_high, step,
           median(transfer_s) AS transfer_s, max(calls) AS calls,
           median(transfer_net_s) AS transfer_net_s,
           list(rank ORDER BY rank) AS members
    FROM per_member
    GROUP BY ALL
)
SELECT * FROM final;
