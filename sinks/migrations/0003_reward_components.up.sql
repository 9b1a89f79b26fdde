-- reward_components: one row per RewardSignal, as it arrived from its source.
-- Read path: "why did step S get -0.3" (WHERE session_id = ? AND logical_event_id = ?), per-source statistics
-- (GROUP BY source, name). reward_components_latest reads with FINAL so a replayed signal counts once.
CREATE TABLE IF NOT EXISTS {database}.reward_components
(
    logical_event_id String COMMENT 'The step judged.',
    session_id String COMMENT 'Session of the step.',
    event_id String COMMENT 'UUIDv7 of the RewardSignal; the idempotency key.',
    agent_id LowCardinality(String) COMMENT 'Producer of the signal (a reward source or the agent).',
    episode_id String COMMENT 'Episode of the step.',
    source LowCardinality(String) COMMENT 'Reward source, e.g. llm_judge, revenue_job, human_review.',
    name LowCardinality(String) COMMENT 'Dimension judged, e.g. helpfulness, safety.',
    value Float64 COMMENT 'The reward value.',
    confidence Float64 COMMENT 'Source confidence in [0, 1].',
    annotator LowCardinality(String) COMMENT 'LLM, CODE or HUMAN.',
    evidence Nullable(String) COMMENT 'Reference to or text of the evidence behind the value.',
    event_time DateTime64(6, 'UTC') COMMENT 'When the source produced the signal.',
    policy_version LowCardinality(String) COMMENT 'Policy version carried by the signal envelope.',
    trace_id String COMMENT 'Trace id of the step.',
    ingested_revision UInt32 COMMENT 'Revision of the sink row format; a replay through a newer mapper replaces older rows.'
)
ENGINE = ReplacingMergeTree(ingested_revision)
PARTITION BY toYYYYMM(event_time)
ORDER BY (session_id, logical_event_id, event_id)
COMMENT 'Reward signals, one row per event_id after merges; read reward_components_latest.';

CREATE OR REPLACE VIEW {database}.reward_components_latest
AS SELECT * FROM {database}.reward_components FINAL;
