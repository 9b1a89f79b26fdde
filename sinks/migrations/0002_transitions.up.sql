-- transitions: the replay table. One row per (session_id, step, logical_event_id) and revision; the highest revision
-- is the current row (a late tool result or reward produces a new revision).
-- Read path: a trainer scans sessions in step order (ORDER BY session_id, step); analysts filter by session, tool,
-- reward_status. reward_components is Nested, so `ARRAY JOIN reward_components` gives one row per component.
-- transitions_latest reads with FINAL: one row per step with the newest revision's values, whatever the insert order.
CREATE TABLE IF NOT EXISTS {database}.transitions
(
    session_id String COMMENT 'Session of the step.',
    step Int64 COMMENT '0-based index of the action within the session.',
    logical_event_id String COMMENT 'Step id shared by dispatch, tool result and rewards.',
    revision UInt32 COMMENT 'Number of distinct input events folded in; the highest revision is the current row.',
    agent_id LowCardinality(String) COMMENT 'Agent that acted.',
    episode_id String COMMENT 'Episode of the step.',
    trace_id String COMMENT 'Trace id of the step.',
    policy_version LowCardinality(String) COMMENT 'Policy that chose the action.',
    tool LowCardinality(String) COMMENT 'Tool called.',
    params_json String COMMENT 'Call parameters (JSON).',
    dispatched_at DateTime64(6, 'UTC') COMMENT 'event_time of the dispatch.',
    tool_status LowCardinality(Nullable(String)) COMMENT 'OK, ERROR, TIMEOUT, REJECTED; NULL while no result has arrived.',
    output Nullable(String) COMMENT 'Tool output.',
    error Nullable(String) COMMENT 'Tool error message.',
    latency_ms Nullable(Float64) COMMENT 'Tool latency in milliseconds.',
    cost_usd Float64 COMMENT 'Tool cost in US dollars.',
    tokens_in Int64 COMMENT 'Input tokens.',
    tokens_out Int64 COMMENT 'Output tokens.',
    result_at Nullable(DateTime64(6, 'UTC')) COMMENT 'event_time of the tool result.',
    reward Nullable(Float64) COMMENT 'Fused reward; NULL while no component has arrived.',
    reward_status LowCardinality(String) COMMENT 'pending, complete, partial or imputed.',
    reward_revision UInt32 COMMENT 'Revision of the woven reward this row carries.',
    reward_components Nested(
        event_id String,
        source LowCardinality(String),
        name LowCardinality(String),
        value Float64,
        confidence Float64,
        weight Float64,
        annotator LowCardinality(String),
        event_time DateTime64(6, 'UTC')
    ) COMMENT 'Reward signals behind reward, one array element per component.',
    updated_at DateTime64(6, 'UTC') COMMENT 'Largest event_time among the step inputs (deterministic).',
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(revision)
PARTITION BY toYYYYMM(dispatched_at)
ORDER BY (session_id, step, logical_event_id)
COMMENT 'Replay rows, one per step and revision; read transitions_latest for the current row of each step.';

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;
