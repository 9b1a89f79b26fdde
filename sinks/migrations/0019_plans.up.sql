-- Plans as events (docs/plans.md): what the plan_events topic carries (plans submitted, subgoal statuses from
-- executors, executor heartbeats) and what the plans scheduler decided (plan_decisions), with the views that answer
-- "what happened to plan P": each subgoal's state history with validity ranges, its attempts, time per state,
-- queueing delay per resource class and GPU memory released against what executors advertised.
-- Read path: everything about one plan is a primary-key range (session_id, plan_id); a plan id alone (the CLI
-- without --session) is helped by a bloom-filter index. Heartbeats are read per resource class over time.
-- Every table is a ReplacingMergeTree keyed on the record's identity, so a replay after a crash keeps one row.
CREATE TABLE IF NOT EXISTS {database}.plans
(
    session_id String COMMENT 'Session of the plan.',
    plan_id String COMMENT 'Plan id, unique per session.',
    episode_id String COMMENT 'Episode of the plan.',
    agent_id String COMMENT 'Agent (planner) that submitted it.',
    goal String COMMENT 'What the plan is for, in words.',
    event_id String COMMENT 'event_id of the PlanSubmitted record kept.',
    subgoal_count UInt32 COMMENT 'Subgoals in the plan.',
    submitted_at DateTime64(6, 'UTC') COMMENT 'event_time of the submission.',
    keep_first UInt64 COMMENT '2^63 - submitted_at: the earliest submission of a plan id wins (the scheduler refuses a different plan under the same id).',
    INDEX idx_plan_id plan_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(keep_first)
ORDER BY (session_id, plan_id)
COMMENT 'Plans submitted, one row per (session, plan) after merges; read plans_latest.';

CREATE TABLE IF NOT EXISTS {database}.plan_subgoals
(
    session_id String COMMENT 'Session of the plan.',
    plan_id String COMMENT 'The plan.',
    subgoal_id String COMMENT 'The subgoal (a node of the DAG).',
    position UInt32 COMMENT 'Index in the plan''s list (the release order of ties).',
    event_id String COMMENT 'event_id of the submission it came with (joins plans).',
    tool Nullable(String) COMMENT 'Tool the executor runs.',
    agent Nullable(String) COMMENT 'Agent the subgoal is handed to.',
    params_json String COMMENT 'Parameters (JSON object).',
    resource_class LowCardinality(String) COMMENT 'Executors that may run it.',
    gpu_memory_mb Int64 COMMENT 'Profile: GPU memory, MiB.',
    gpus Int32 COMMENT 'Profile: whole GPUs.',
    cpu Int32 COMMENT 'Profile: CPU slots.',
    deadline_s Float64 COMMENT 'Seconds an attempt may go without a sign of life.',
    max_attempts Int32 COMMENT 'Retry policy: attempts (of the subgoal, then of its fallback).',
    backoff_s Float64 COMMENT 'Retry policy: seconds before the first retry.',
    backoff_multiplier Float64 COMMENT 'Retry policy: growth of the backoff.',
    has_fallback UInt8 COMMENT '1 when a fallback runs once the attempts are spent.',
    fallback_tool Nullable(String) COMMENT 'Fallback tool.',
    fallback_agent Nullable(String) COMMENT 'Fallback agent.',
    fallback_params_json Nullable(String) COMMENT 'Fallback parameters.',
    fallback_resource_class Nullable(String) COMMENT 'Fallback resource class.',
    fallback_gpu_memory_mb Int64 COMMENT 'Fallback profile: GPU memory, MiB.',
    fallback_gpus Int32 COMMENT 'Fallback profile: GPUs.',
    fallback_cpu Int32 COMMENT 'Fallback profile: CPU slots.',
    depends_on Array(String) COMMENT 'Subgoals that must succeed first (the DAG''s edges).',
    submitted_at DateTime64(6, 'UTC') COMMENT 'event_time of the submission.',
    keep_first UInt64 COMMENT 'As in plans: the earliest submission wins.',
    INDEX idx_plan_id plan_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(keep_first)
ORDER BY (session_id, plan_id, subgoal_id)
COMMENT 'The subgoals of each plan, one row per subgoal; read plan_subgoals_latest.';

CREATE TABLE IF NOT EXISTS {database}.subgoal_statuses
(
    session_id String COMMENT 'Session of the plan.',
    plan_id String COMMENT 'The plan.',
    subgoal_id String COMMENT 'The subgoal.',
    attempt Int32 COMMENT 'Attempt reported on (1-based).',
    state LowCardinality(String) COMMENT 'RUNNING, HEARTBEAT, SUCCEEDED or FAILED.',
    executor_id String COMMENT 'Executor that reported it.',
    output_ref Nullable(String) COMMENT 'SUCCEEDED: where the output is.',
    error_class Nullable(String) COMMENT 'FAILED: class of the error.',
    error Nullable(String) COMMENT 'FAILED: the error message.',
    event_id String COMMENT 'event_id of the status.',
    event_time DateTime64(6, 'UTC') COMMENT 'event_time of the status.'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(event_time)
ORDER BY (session_id, plan_id, subgoal_id, attempt, event_time, event_id)
COMMENT 'Executors'' reports on attempts, as received (stale ones included); read subgoal_statuses_latest.';

CREATE TABLE IF NOT EXISTS {database}.executor_heartbeats
(
    executor_id String COMMENT 'Executor.',
    resource_class LowCardinality(String) COMMENT 'Resource class it serves.',
    free_gpu_memory_mb Int64 COMMENT 'GPU memory advertised free for new work, MiB.',
    free_gpus Int32 COMMENT 'Whole GPUs advertised free.',
    free_cpu Int32 COMMENT 'CPU slots advertised free.',
    running Array(String) COMMENT 'Attempts it runs (session/plan/subgoal/attempt).',
    valid_for_s Float64 COMMENT 'Seconds the advertisement holds.',
    host String COMMENT 'Host it runs on.',
    sent_at DateTime64(6, 'UTC') COMMENT 'When it was sent (the scheduler''s clock).'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(sent_at)
ORDER BY (resource_class, executor_id, sent_at)
COMMENT 'Capacity advertisements, one row per (executor, sent_at); read executor_heartbeats_latest.';

CREATE TABLE IF NOT EXISTS {database}.plan_decisions
(
    decision_id String COMMENT 'Deterministic id (session/plan/subgoal/attempt/kind, session/plan/finished).',
    kind LowCardinality(String) COMMENT 'released, retried, rerouted, timed_out, escalated or finished.',
    session_id String COMMENT 'Session of the plan.',
    episode_id String COMMENT 'Episode of the plan.',
    plan_id String COMMENT 'The plan.',
    subgoal_id String COMMENT 'The subgoal (empty for finished).',
    attempt Int32 COMMENT 'released, timed_out: the attempt; retried, rerouted: the failed one; escalated, finished: attempts made.',
    next_attempt Nullable(Int32) COMMENT 'retried, rerouted: the next attempt.',
    resource_class LowCardinality(String) COMMENT 'released: class whose capacity it holds.',
    work_topic String COMMENT 'released: the work topic.',
    executor_id Nullable(String) COMMENT 'released: executor it was counted against.',
    tool Nullable(String) COMMENT 'released, rerouted: tool to run.',
    agent Nullable(String) COMMENT 'released, rerouted: agent.',
    params_json String COMMENT 'released: parameters.',
    gpu_memory_mb Int64 COMMENT 'released: GPU memory held, MiB.',
    gpus Int32 COMMENT 'released: GPUs held.',
    cpu Int32 COMMENT 'released: CPU slots held.',
    deadline_s Float64 COMMENT 'released, timed_out: the deadline.',
    fallback UInt8 COMMENT 'released: 1 when the attempt runs the fallback.',
    error_class String COMMENT 'retried, rerouted, escalated: the failure''s class (timeout for a timeout).',
    retry_at Nullable(DateTime64(6, 'UTC')) COMMENT 'retried: when the next attempt may be released.',
    last_seen_at Nullable(DateTime64(6, 'UTC')) COMMENT 'timed_out: the attempt''s last sign of life.',
    cancelled Array(String) COMMENT 'escalated, finished: subgoals cancelled.',
    outcome LowCardinality(String) COMMENT 'finished: SUCCEEDED or FAILED.',
    succeeded Array(String) COMMENT 'finished: subgoals that succeeded.',
    escalated Array(String) COMMENT 'finished: subgoals escalated.',
    decided_at DateTime64(6, 'UTC') COMMENT 'Scheduler event time of the decision.'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(decided_at)
ORDER BY (session_id, plan_id, decision_id)
COMMENT 'The plans scheduler''s decisions, one row per decision_id (a replay decides the same); read plan_decisions_latest.';

CREATE OR REPLACE VIEW {database}.plans_latest AS SELECT * FROM {database}.plans FINAL;
-- Only the subgoals of the submission kept in plans (a refused, different plan under the same id adds none).
CREATE OR REPLACE VIEW {database}.plan_subgoals_latest AS
SELECT * FROM {database}.plan_subgoals FINAL
WHERE (session_id, plan_id, event_id) IN (SELECT session_id, plan_id, event_id FROM {database}.plans FINAL);
CREATE OR REPLACE VIEW {database}.subgoal_statuses_latest AS SELECT * FROM {database}.subgoal_statuses FINAL;
CREATE OR REPLACE VIEW {database}.executor_heartbeats_latest AS SELECT * FROM {database}.executor_heartbeats FINAL;
CREATE OR REPLACE VIEW {database}.plan_decisions_latest AS SELECT * FROM {database}.plan_decisions FINAL;

-- One row per released attempt: released -> running (first RUNNING or HEARTBEAT) -> ended (first SUCCEEDED or
-- FAILED, or the timeout), with its executor and outcome (SUCCEEDED, FAILED, TIMED_OUT; empty while it runs).
-- Reports sent at or after the attempt's timeout do not change its outcome, as they do not for the scheduler, except
-- that a late success still completes the subgoal (it was slow, not dead): `succeeded_at` is when the attempt's
-- success counted for the subgoal (its SUCCEEDED report, even after a timeout), NULL otherwise. (No join_use_nulls:
-- a read-only session cannot set it, so what the LEFT JOINs may miss is Nullable, whose default is NULL.)
CREATE OR REPLACE VIEW {database}.plan_attempts AS
SELECT
    r.session_id AS session_id, r.plan_id AS plan_id, r.subgoal_id AS subgoal_id, r.attempt AS attempt,
    r.resource_class AS resource_class, r.executor_id AS executor_id, r.fallback AS fallback, r.tool AS tool,
    r.agent AS agent, r.gpu_memory_mb AS gpu_memory_mb, r.gpus AS gpus, r.cpu AS cpu,
    r.decided_at AS released_at,
    if(s.running_at IS NOT NULL AND (t.timed_out_at IS NULL OR s.running_at < t.timed_out_at)
       AND (s.ended_at IS NULL OR s.running_at <= s.ended_at), s.running_at, NULL) AS running_at,
    (s.ended_at IS NOT NULL AND (t.timed_out_at IS NULL OR s.ended_at < t.timed_out_at)) AS reported_end,
    if(reported_end, s.ended_at, t.timed_out_at) AS ended_at,
    multiIf(reported_end, s.end_state, t.timed_out_at IS NOT NULL, 'TIMED_OUT', '') AS outcome,
    multiIf(outcome = 'FAILED', s.error_class, outcome = 'TIMED_OUT', 'timeout', NULL) AS error_class,
    if(outcome = 'SUCCEEDED', s.output_ref, NULL) AS output_ref,
    s.reported_by AS reported_by,
    if(t.timed_out_at IS NOT NULL, s.succeeded_at, if(outcome = 'SUCCEEDED', ended_at, NULL)) AS succeeded_at,
    (toUnixTimestamp64Micro(running_at) - toUnixTimestamp64Micro(released_at)) / 1e6 AS start_delay_s,
    (toUnixTimestamp64Micro(ended_at) - toUnixTimestamp64Micro(released_at)) / 1e6 AS duration_s
FROM (SELECT * FROM {database}.plan_decisions FINAL WHERE kind = 'released') AS r
LEFT JOIN (
    SELECT
        session_id, plan_id, subgoal_id, attempt,
        minIfOrNull(event_time, state IN ('RUNNING', 'HEARTBEAT')) AS running_at,
        minIfOrNull(event_time, state IN ('SUCCEEDED', 'FAILED')) AS ended_at,
        argMinIf(toString(state), event_time, state IN ('SUCCEEDED', 'FAILED')) AS end_state,
        argMinIf(error_class, event_time, state = 'FAILED') AS error_class,
        argMinIf(output_ref, event_time, state = 'SUCCEEDED') AS output_ref,
        minIfOrNull(event_time, state = 'SUCCEEDED') AS succeeded_at,
        argMaxIf(executor_id, event_time, executor_id != '') AS reported_by
    FROM {database}.subgoal_statuses FINAL
    GROUP BY session_id, plan_id, subgoal_id, attempt
) AS s ON s.session_id = r.session_id AND s.plan_id = r.plan_id AND s.subgoal_id = r.subgoal_id
    AND s.attempt = r.attempt
LEFT JOIN (
    SELECT session_id, plan_id, subgoal_id, attempt, toNullable(decided_at) AS timed_out_at
    FROM {database}.plan_decisions FINAL WHERE kind = 'timed_out'
) AS t ON t.session_id = r.session_id AND t.plan_id = r.plan_id AND t.subgoal_id = r.subgoal_id
    AND t.attempt = r.attempt;

-- Each subgoal's states with validity ranges, like the state graph's intervals: valid_from <= t < valid_to, the
-- current state open until 2299-12-31. States are the scheduler's (processors.plans.dag.NodeState): WAITING, READY,
-- RELEASED, RUNNING, BACKOFF, SUCCEEDED, ESCALATED, CANCELLED. `attempt` is the attempt the state belongs to (READY:
-- the attempt it waits to release; BACKOFF, ESCALATED: the failed one; 0 for WAITING and CANCELLED).
CREATE OR REPLACE VIEW {database}.subgoal_state_history AS
SELECT
    session_id, plan_id, subgoal_id, state, attempt, at AS valid_from,
    leadInFrame(at, 1, toDateTime64('2299-12-31 23:59:59', 6, 'UTC')) OVER w AS valid_to,
    lagInFrame(state, 1, '') OVER w AS previous_state
FROM
(
    -- nothing after the first terminal state (e.g. the attempt a late success superseded)
    SELECT *, minIf(n, state IN ('SUCCEEDED', 'ESCALATED', 'CANCELLED'))
        OVER (PARTITION BY session_id, plan_id, subgoal_id) AS last_n
    FROM
    (
        SELECT *, row_number() OVER (PARTITION BY session_id, plan_id, subgoal_id ORDER BY at, attempt, rank) AS n
        FROM
        (
    SELECT session_id, plan_id, subgoal_id, 'WAITING' AS state,
        submitted_at AS at, toInt32(0) AS attempt, toUInt8(0) AS rank
    FROM {database}.plan_subgoals_latest WHERE notEmpty(depends_on)
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'READY', submitted_at, toInt32(1), toUInt8(1)
    FROM {database}.plan_subgoals_latest WHERE empty(depends_on)
    UNION ALL
    SELECT g.session_id, g.plan_id, g.subgoal_id, 'READY', max(d.first_success), toInt32(1), toUInt8(1)
    FROM (
        SELECT session_id, plan_id, subgoal_id, dep, length(depends_on) AS deps
        FROM {database}.plan_subgoals_latest ARRAY JOIN depends_on AS dep
    ) AS g
    INNER JOIN (
        SELECT session_id, plan_id, subgoal_id, min(assumeNotNull(succeeded_at)) AS first_success
        FROM {database}.plan_attempts WHERE succeeded_at IS NOT NULL GROUP BY session_id, plan_id, subgoal_id
    ) AS d ON d.session_id = g.session_id AND d.plan_id = g.plan_id AND d.subgoal_id = g.dep
    GROUP BY g.session_id, g.plan_id, g.subgoal_id, g.deps
    HAVING uniqExact(g.dep) = g.deps
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'RELEASED', released_at, attempt, toUInt8(2) FROM {database}.plan_attempts
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'RUNNING', assumeNotNull(running_at), attempt, toUInt8(3)
    FROM {database}.plan_attempts WHERE running_at IS NOT NULL
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'SUCCEEDED', min(assumeNotNull(succeeded_at)),
        argMin(attempt, assumeNotNull(succeeded_at)), toUInt8(4)
    FROM {database}.plan_attempts WHERE succeeded_at IS NOT NULL GROUP BY session_id, plan_id, subgoal_id
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'BACKOFF', decided_at, attempt, toUInt8(5)
    FROM {database}.plan_decisions_latest WHERE kind = 'retried' AND assumeNotNull(retry_at) > decided_at
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'READY', if(kind = 'retried', assumeNotNull(retry_at), decided_at),
        assumeNotNull(next_attempt), toUInt8(1)
    FROM {database}.plan_decisions_latest WHERE kind IN ('retried', 'rerouted')
    UNION ALL
    SELECT session_id, plan_id, subgoal_id, 'ESCALATED', decided_at, attempt, toUInt8(7)
    FROM {database}.plan_decisions_latest WHERE kind = 'escalated'
    UNION ALL
    SELECT session_id, plan_id, cancelled_id, 'CANCELLED', decided_at, toInt32(0), toUInt8(7)
    FROM {database}.plan_decisions_latest ARRAY JOIN cancelled AS cancelled_id WHERE kind = 'escalated'
        )
    )
)
WHERE n <= last_n OR last_n = 0
WINDOW w AS (PARTITION BY session_id, plan_id, subgoal_id ORDER BY at, attempt, rank
             ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING);

-- Time each subgoal spent in each state (closed intervals only: the current state is still counting).
CREATE OR REPLACE VIEW {database}.subgoal_time_in_state AS
SELECT
    session_id, plan_id, subgoal_id, state, count() AS intervals,
    sum(toUnixTimestamp64Micro(valid_to) - toUnixTimestamp64Micro(valid_from)) / 1e6 AS seconds
FROM {database}.subgoal_state_history
WHERE valid_to < toDateTime64('2299-12-31 23:59:59', 6, 'UTC')
GROUP BY session_id, plan_id, subgoal_id, state;

-- Queueing delay of each attempt: ready -> released (waiting for capacity) and released -> running (the executor
-- taking it up; NULL until it reports).
CREATE OR REPLACE VIEW {database}.plan_queueing_delays AS
SELECT
    a.session_id AS session_id, a.plan_id AS plan_id, a.subgoal_id AS subgoal_id, a.attempt AS attempt,
    a.resource_class AS resource_class, h.valid_from AS ready_at, a.released_at AS released_at,
    a.running_at AS running_at,
    (toUnixTimestamp64Micro(a.released_at) - toUnixTimestamp64Micro(h.valid_from)) / 1e6 AS ready_to_released_s,
    a.start_delay_s AS released_to_running_s
FROM {database}.plan_attempts AS a
INNER JOIN (
    SELECT session_id, plan_id, subgoal_id, attempt, valid_from FROM {database}.subgoal_state_history
    WHERE state = 'READY'
) AS h ON h.session_id = a.session_id AND h.plan_id = a.plan_id AND h.subgoal_id = a.subgoal_id
    AND h.attempt = a.attempt;

-- The same per resource class.
CREATE OR REPLACE VIEW {database}.plan_queueing_by_class AS
SELECT
    resource_class, count() AS attempts,
    avg(ready_to_released_s) AS ready_to_released_avg_s,
    quantileExact(0.5)(ready_to_released_s) AS ready_to_released_p50_s,
    quantileExact(0.99)(ready_to_released_s) AS ready_to_released_p99_s,
    max(ready_to_released_s) AS ready_to_released_max_s,
    countIf(released_to_running_s IS NOT NULL) AS started,
    avgOrNull(released_to_running_s) AS released_to_running_avg_s,
    quantileExactOrNull(0.5)(released_to_running_s) AS released_to_running_p50_s,
    maxOrNull(released_to_running_s) AS released_to_running_max_s
FROM {database}.plan_queueing_delays
GROUP BY resource_class;

-- GPU memory per resource class and minute: what the scheduler released (sum of the released attempts' profiles)
-- against what executors advertised free (each executor's last advertisement of the minute, and its largest,
-- summed over the class's executors).
CREATE OR REPLACE VIEW {database}.plan_gpu_memory AS
SELECT
    resource_class, minute,
    sum(releases) AS releases,
    sum(released_mb) AS released_gpu_memory_mb,
    sum(executors) AS executors,
    sum(last_free_mb) AS advertised_free_gpu_memory_mb,
    sum(max_free_mb) AS max_advertised_free_gpu_memory_mb
FROM
(
    SELECT resource_class, toStartOfMinute(decided_at) AS minute, count() AS releases,
        sum(gpu_memory_mb) AS released_mb, toUInt64(0) AS executors, toInt64(0) AS last_free_mb,
        toInt64(0) AS max_free_mb
    FROM {database}.plan_decisions_latest WHERE kind = 'released'
    GROUP BY resource_class, minute
    UNION ALL
    SELECT resource_class, minute, toUInt64(0), toInt64(0), count(), sum(last_free), sum(max_free)
    FROM (
        SELECT resource_class, executor_id, toStartOfMinute(sent_at) AS minute,
            argMax(free_gpu_memory_mb, sent_at) AS last_free, max(free_gpu_memory_mb) AS max_free
        FROM {database}.executor_heartbeats_latest
        GROUP BY resource_class, executor_id, minute
    )
    GROUP BY resource_class, minute
)
GROUP BY resource_class, minute;

-- The critical path of a finished plan (the longest chain of dependencies by duration) is computed in Python from
-- plan_subgoals_latest and subgoal_state_history (treadle.reports.plan_graph.critical_path; `treadle plan show`).
