-- Needs derived_* of 010_derived.sql and a relation run_collectives (see there).

-- The per-(run, rank, step) summary: raw step row plus its communication split.
-- compute_s = step time - blocking (time this rank was not waiting for others); known on
-- traced steps (collectives recorded one by one), NULL elsewhere.
CREATE OR REPLACE TEMP VIEW derived_steps AS
WITH comm AS (
    SELECT run_id, rank, step, sum(transfer_s) AS comm_transfer_s,
           sum(blocking_s) AS comm_blocking_s
    FROM run_collectives
    GROUP BY ALL
),
final AS (
    SELECT s.*, c.comm_transfer_s, c.comm_blocking_s,
           s.step_time_s - c.comm_blocking_s AS compute_s,
           coalesce(s.gpu_max_allocated_bytes, s.mem_rss_peak_bytes) AS mem_peak_bytes
    FROM src_steps s LEFT JOIN comm c USING (run_id, rank, step)
)
SELECT * FROM final;
