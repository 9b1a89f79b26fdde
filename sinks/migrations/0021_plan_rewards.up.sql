-- Rewards rolled up per subgoal and per plan (issue 27, item 3). A treadle.Executor's step-path events carry the
-- envelope attributes plan_id, subgoal_id, attempt and plan_session_id, in a session of their own per attempt; the
-- rewards of those steps are woven like any step's (woven_rewards). raw_events keeps the attributes but is keyed by
-- (session_id, event_id), so "the steps of plan P" would scan it: plan_steps holds one row per dispatch of plan work,
-- keyed by the plan, filled by plan_steps_mv as the sink inserts raw_events (and backfilled below from what is there).
-- Read path: filter the views on plan_session_id and plan_id (as `treadle plan show` does): the filter reaches
-- plan_steps' primary key, and the join with woven_rewards is built from that plan's steps. Last revision only.
CREATE TABLE IF NOT EXISTS {database}.plan_steps
(
    plan_session_id String COMMENT 'Session of the plan (attribute plan_session_id).',
    plan_id String COMMENT 'The plan (attribute plan_id).',
    subgoal_id String COMMENT 'The subgoal (attribute subgoal_id).',
    attempt UInt32 COMMENT 'The attempt (attribute attempt).',
    session_id String COMMENT 'The attempt''s own step session (woven_rewards and transitions key on it).',
    logical_event_id String COMMENT 'The step (dispatch) id.',
    executor_id String COMMENT 'Executor that ran the attempt (attribute executor_id).',
    tool LowCardinality(String) COMMENT 'Tool dispatched.',
    dispatched_at DateTime64(6, 'UTC') COMMENT 'event_time of the dispatch.',
    event_id String COMMENT 'event_id of the dispatch.'
)
ENGINE = ReplacingMergeTree
ORDER BY (plan_session_id, plan_id, subgoal_id, attempt, session_id, logical_event_id)
COMMENT 'Dispatches of plan work, one row per step after merges; fed by plan_steps_mv from raw_events.';

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.plan_steps_mv
TO {database}.plan_steps
AS SELECT
    r.attributes['plan_session_id'] AS plan_session_id,
    r.attributes['plan_id'] AS plan_id,
    r.attributes['subgoal_id'] AS subgoal_id,
    toUInt32OrZero(r.attributes['attempt']) AS attempt,
    r.session_id AS session_id,
    r.logical_event_id AS logical_event_id,
    r.attributes['executor_id'] AS executor_id,
    JSONExtractString(r.payload_json, 'tool') AS tool,
    r.event_time AS dispatched_at,
    r.event_id AS event_id
FROM {database}.raw_events AS r
WHERE r.kind = 'actions' AND r.attributes['plan_id'] != '';

INSERT INTO {database}.plan_steps
SELECT
    r.attributes['plan_session_id'] AS plan_session_id,
    r.attributes['plan_id'] AS plan_id,
    r.attributes['subgoal_id'] AS subgoal_id,
    toUInt32OrZero(r.attributes['attempt']) AS attempt,
    r.session_id AS session_id,
    r.logical_event_id AS logical_event_id,
    r.attributes['executor_id'] AS executor_id,
    JSONExtractString(r.payload_json, 'tool') AS tool,
    r.event_time AS dispatched_at,
    r.event_id AS event_id
FROM {database}.raw_events AS r
WHERE r.kind = 'actions' AND r.attributes['plan_id'] != '';

-- One row per step of plan work with its current fused reward (NULL while none is woven) and components: the
-- highest revision of the live woven rewards, as woven_rewards_latest picks it (argMax by revision), taken after the
-- join so that a filter on the plan reaches plan_steps and the join (built from those few steps) filters the
-- woven_rewards scan at run time instead of aggregating every step's revisions first. Columns are qualified (w., p.)
-- because ClickHouse aliases are global.
CREATE OR REPLACE VIEW {database}.plan_step_rewards
AS SELECT
    p.plan_session_id AS plan_session_id,
    p.plan_id AS plan_id,
    p.subgoal_id AS subgoal_id,
    p.attempt AS attempt,
    p.session_id AS session_id,
    p.logical_event_id AS logical_event_id,
    p.executor_id AS executor_id,
    p.tool AS tool,
    p.dispatched_at AS dispatched_at,
    max(w.revision) AS reward_revision,
    if(reward_revision > 0, argMax(w.value, w.revision), NULL) AS reward,
    if(reward_revision > 0, argMax(w.status, w.revision), 'pending') AS reward_status,
    argMax(w.components.source, w.revision) AS `components.source`,
    argMax(w.components.name, w.revision) AS `components.name`,
    argMax(w.components.value, w.revision) AS `components.value`
FROM (SELECT * FROM {database}.plan_steps FINAL) AS p
LEFT JOIN (SELECT * FROM {database}.woven_rewards WHERE variant = 'live') AS w
    ON w.session_id = p.session_id AND w.logical_event_id = p.logical_event_id
GROUP BY plan_session_id, plan_id, subgoal_id, attempt, session_id, logical_event_id, executor_id, tool, dispatched_at;

-- Each step of plan work with its rewards as (source, name, value, present) parts: the fused reward first (source and
-- name empty; present = 0 while none is woven), then one per component. The two roll-ups below array-join these.
CREATE OR REPLACE VIEW {database}.plan_step_reward_parts
AS SELECT
    s.plan_session_id AS plan_session_id,
    s.plan_id AS plan_id,
    s.subgoal_id AS subgoal_id,
    s.attempt AS attempt,
    s.logical_event_id AS logical_event_id,
    arrayConcat(
        [tuple('', '', ifNull(s.reward, 0.), s.reward IS NOT NULL)],
        arrayMap((src, nm, v) -> tuple(toString(src), toString(nm), v, true),
                 s.`components.source`, s.`components.name`, s.`components.value`)
    ) AS parts
FROM {database}.plan_step_rewards AS s;

-- Per plan, subgoal and attempt: one row for the fused reward (source = '' and name = '') and one per reward source
-- and name. steps: the attempt's dispatches; rewarded_steps: those with a reward of that source and name (or a fused
-- one); rewards: how many (a step judged twice by one source and name counts twice); reward_mean = reward_sum / rewards.
CREATE OR REPLACE VIEW {database}.plan_subgoal_rewards
AS SELECT
    plan_session_id,
    plan_id,
    subgoal_id,
    attempt,
    part.1 AS source,
    part.2 AS name,
    any(attempt_steps) AS steps,
    uniqExactIf(logical_event_id, part.4) AS rewarded_steps,
    countIf(part.4) AS rewards,
    sumIf(part.3, part.4) AS reward_sum,
    if(rewards = 0, NULL, reward_sum / rewards) AS reward_mean
FROM
(
    SELECT
        s.plan_session_id AS plan_session_id,
        s.plan_id AS plan_id,
        s.subgoal_id AS subgoal_id,
        s.attempt AS attempt,
        s.logical_event_id AS logical_event_id,
        count() OVER (PARTITION BY s.plan_session_id, s.plan_id, s.subgoal_id, s.attempt) AS attempt_steps,
        s.parts AS parts
    FROM {database}.plan_step_reward_parts AS s
)
ARRAY JOIN parts AS part
GROUP BY plan_session_id, plan_id, subgoal_id, attempt, source, name;

-- Per plan: the same over all its subgoals and attempts. steps: the plan's dispatches (all of them, on every row);
-- subgoals and attempts: those with a reward of that source and name (or a fused one).
CREATE OR REPLACE VIEW {database}.plan_rewards
AS SELECT
    plan_session_id,
    plan_id,
    part.1 AS source,
    part.2 AS name,
    uniqExactIf(subgoal_id, part.4) AS subgoals,
    uniqExactIf(subgoal_id, attempt, part.4) AS attempts,
    any(plan_steps) AS steps,
    uniqExactIf(logical_event_id, part.4) AS rewarded_steps,
    countIf(part.4) AS rewards,
    sumIf(part.3, part.4) AS reward_sum,
    if(rewards = 0, NULL, reward_sum / rewards) AS reward_mean
FROM
(
    SELECT
        s.plan_session_id AS plan_session_id,
        s.plan_id AS plan_id,
        s.subgoal_id AS subgoal_id,
        s.attempt AS attempt,
        s.logical_event_id AS logical_event_id,
        count() OVER (PARTITION BY s.plan_session_id, s.plan_id) AS plan_steps,
        s.parts AS parts
    FROM {database}.plan_step_reward_parts AS s
)
ARRAY JOIN parts AS part
GROUP BY plan_session_id, plan_id, source, name;
