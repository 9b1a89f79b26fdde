-- woven_rewards: every revision of every step's fused reward, kept as its own row, so the history of a reward
-- ("it was 0.8 until the human label arrived") stays queryable.
-- Read path: a step's revisions (WHERE session_id = ? AND logical_event_id = ? ORDER BY revision), and the current
-- fused reward per step through woven_rewards_latest (argMax by revision, grouped by step: correct across partitions
-- and whatever the insert order). Re-inserting a revision is harmless: ReplacingMergeTree keeps one row per key.
CREATE TABLE IF NOT EXISTS {database}.woven_rewards
(
    logical_event_id String COMMENT 'The step judged.',
    session_id String COMMENT 'Session of the step.',
    episode_id String COMMENT 'Episode of the step.',
    step Int64 COMMENT 'Step index in the session (-1 while the dispatch has not arrived).',
    revision UInt32 COMMENT 'Number of distinct components fused; deterministic for the same inputs.',
    value Float64 COMMENT 'Fused reward value.',
    status LowCardinality(String) COMMENT 'complete, partial or imputed.',
    fusion LowCardinality(String) COMMENT 'Fusion policy that produced value.',
    policy_version LowCardinality(String) COMMENT 'Version of the reward policy applied.',
    components Nested(
        event_id String,
        source LowCardinality(String),
        name LowCardinality(String),
        value Float64,
        confidence Float64,
        weight Float64,
        annotator LowCardinality(String),
        event_time DateTime64(6, 'UTC')
    ) COMMENT 'Components fused, ordered by event_id.',
    woven_at DateTime64(6, 'UTC') COMMENT 'Largest event_time among the step inputs (deterministic).'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(woven_at)
ORDER BY (session_id, logical_event_id, revision)
COMMENT 'Fused rewards, every revision kept; read woven_rewards_latest for the current one per step.';

-- Columns are qualified with w. because ClickHouse aliases are global: `max(revision) AS revision` would
-- otherwise capture the revision inside argMax(..., revision).
CREATE OR REPLACE VIEW {database}.woven_rewards_latest
AS SELECT
    w.session_id AS session_id,
    w.logical_event_id AS logical_event_id,
    max(w.revision) AS revision,
    argMax(w.episode_id, w.revision) AS episode_id,
    argMax(w.step, w.revision) AS step,
    argMax(w.value, w.revision) AS value,
    argMax(w.status, w.revision) AS status,
    argMax(w.fusion, w.revision) AS fusion,
    argMax(w.policy_version, w.revision) AS policy_version,
    argMax(w.components.event_id, w.revision) AS `components.event_id`,
    argMax(w.components.source, w.revision) AS `components.source`,
    argMax(w.components.name, w.revision) AS `components.name`,
    argMax(w.components.value, w.revision) AS `components.value`,
    argMax(w.components.confidence, w.revision) AS `components.confidence`,
    argMax(w.components.weight, w.revision) AS `components.weight`,
    argMax(w.components.annotator, w.revision) AS `components.annotator`,
    argMax(w.components.event_time, w.revision) AS `components.event_time`,
    argMax(w.woven_at, w.revision) AS woven_at
FROM {database}.woven_rewards AS w
GROUP BY w.session_id, w.logical_event_id;
