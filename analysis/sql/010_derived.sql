-- Derived relations over one run's raw telemetry. The raw inputs are the temporary views
-- src_spans, src_steps, src_events and src_ranks: Parquet segments, or registered tables.
-- cur_spans and cur_steps are the same rows less the steps a later attempt redid (a run
-- resumed from a checkpoint records the steps after it again; the latest attempt is kept).
-- Ingest materialises derived_* into the store's tables; a live reader queries them directly.
-- derived_steps (011_steps.sql) reads `run_collectives`: this run's stored collectives during
-- ingest (computed once), derived_collectives for a live reader.

-- One row per collective call per rank, with the transfer / blocking split (OSDI'25 what-if
-- decomposition): transfer = end - max(start of the same instance over its group's members);
-- blocking = the rest, the time this rank waited for a late peer. Async work (wait_ns set: the
-- time the rank was blocked waiting for it) splits only that exposed time: blocking = the late
-- peer's lead, at most the wait; transfer = the rest of the wait.
CREATE OR REPLACE TEMP VIEW derived_collectives AS
WITH rank0 AS (
    SELECT run_id, attempt, host AS rank0_host FROM src_ranks WHERE rank = 0
),
clock AS (  -- clock offsets matter only for ranks on another host than rank 0
    SELECT r.run_id, r.rank, r.attempt,
           CASE WHEN r.host IS DISTINCT FROM r0.rank0_host THEN coalesce(r.clock_offset_ns, 0)
                ELSE 0 END AS offset_ns
    FROM src_ranks r LEFT JOIN rank0 r0 USING (run_id, attempt)
),
calls AS NOT MATERIALIZED (  -- read twice, not held: 8,192 ranks' window is 1.9 GB
    SELECT s.*, coalesce(c.offset_ns, 0) AS offset_ns,
           CASE WHEN s.peer >= 0 THEN greatest(s.rank, s.peer) ELSE -1 END AS pair_rank
    FROM cur_spans s LEFT JOIN clock c USING (run_id, rank, attempt)
    WHERE s.name = 'ranktrace.collective'
),
groups AS (  -- one row per collective instance (a group-by and join beat a window here)
    SELECT run_id, attempt, axis, group_id, pair_rank, seq,
           max(start_ns - offset_ns) AS last_start_ns, count(*) AS members_seen
    FROM calls
    GROUP BY ALL
),
instances AS (
    SELECT c.*, g.last_start_ns, g.members_seen
    FROM calls c JOIN groups g
      ON c.run_id = g.run_id AND c.attempt = g.attempt AND c.axis IS NOT DISTINCT FROM g.axis
     AND c.group_id IS NOT DISTINCT FROM g.group_id AND c.pair_rank = g.pair_rank
     AND c.seq IS NOT DISTINCT FROM g.seq
),
final AS (
    SELECT run_id, rank, step, span_id, parent_span_id, op, axis, group_id, group_size, seq,
           peer, bytes, dtype,
           start_ns, end_ns, wait_ns, core_wait_start_ns, core_wait_end_ns,
           (end_ns - start_ns) / 1e9 AS duration_s,
           CASE WHEN wait_ns IS NULL THEN
               greatest(0, (end_ns - offset_ns) - greatest(start_ns - offset_ns, last_start_ns))
           ELSE wait_ns - least(wait_ns, greatest(0, last_start_ns - (start_ns - offset_ns)))
           END / 1e9 AS transfer_s,
           coalesce(wait_ns, end_ns - start_ns) / 1e9 AS exposed_s,
           members_seen = CASE WHEN peer >= 0 THEN 2 ELSE group_size END AS complete
    FROM instances
)
SELECT * EXCLUDE (exposed_s), exposed_s - transfer_s AS blocking_s FROM final;

-- Step and phase spans; collective spans are stored once, in collectives (view `spans` joins
-- them back).
CREATE OR REPLACE TEMP VIEW derived_span_records AS
SELECT * FROM cur_spans WHERE name <> 'ranktrace.collective';
CREATE OR REPLACE TEMP VIEW derived_events AS SELECT * FROM src_events;
-- One row per rank and attempt (clock offsets and hosts of every launch)...
CREATE OR REPLACE TEMP VIEW derived_rank_attempts AS SELECT * FROM src_ranks;
-- ...and one row per rank: its latest attempt's metadata.
CREATE OR REPLACE TEMP VIEW derived_ranks AS
SELECT * FROM src_ranks QUALIFY attempt = max(attempt) OVER (PARTITION BY run_id, rank);

-- Per (run, attempt, step): every attempt's steps, redone ones included (what a restart cost),
-- from attempt_step_rows: src_steps, or the same rows read back where a window writer has them.
CREATE OR REPLACE TEMP VIEW attempt_step_rows AS SELECT * FROM src_steps;
CREATE OR REPLACE TEMP VIEW derived_attempt_steps AS
SELECT run_id, attempt, step, count(*) AS ranks, max(step_time_s) AS step_time_s,
       min(start_ns) AS start_ns, max(end_ns) AS end_ns
FROM attempt_step_rows
GROUP BY ALL;
