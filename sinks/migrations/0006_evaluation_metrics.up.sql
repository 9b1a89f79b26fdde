-- evaluation_metrics: one row per metric an evaluator processor computed about one input event (e.g. the safety
-- evaluator's safety_alert and pii_leak rows). metric_id is deterministic (evaluator, metric, rule, judged event_id)
-- and event_time is copied from the judged event, so a replay writes the same key and ReplacingMergeTree keeps one row.
-- Read path: "alerts by rule" and "PII-leak rate per episode" over a time range for some policy versions
-- (WHERE evaluator = ? AND metric = ? AND policy_version IN (...) AND event_time BETWEEN ...; GROUP BY rule or
-- episode_id), hence the sort key. evaluation_metrics_latest reads with FINAL so a replayed metric counts once.
CREATE TABLE IF NOT EXISTS {database}.evaluation_metrics
(
    metric_id String COMMENT 'Deterministic id: evaluator, metric, rule and source_event_id.',
    evaluator LowCardinality(String) COMMENT 'Evaluator processor that computed the metric, e.g. safety.',
    metric LowCardinality(String) COMMENT 'What is measured, e.g. safety_alert or pii_leak.',
    rule LowCardinality(String) COMMENT 'Rule that produced the value, e.g. email, credit_card; any_pii for pii_leak.',
    value Float64 COMMENT 'Metric value: 1 per alert; 0 or 1 for rates (avg(value) is the rate).',
    severity LowCardinality(String) COMMENT 'low, medium or high.',
    session_id String COMMENT 'Session of the judged event.',
    episode_id String COMMENT 'Episode of the judged event.',
    logical_event_id String COMMENT 'Step of the judged event.',
    agent_id LowCardinality(String) COMMENT 'Agent that produced the judged event.',
    policy_version LowCardinality(String) COMMENT 'Policy version of the judged event.',
    source_event_id String COMMENT 'event_id of the judged input event.',
    event_time DateTime64(6, 'UTC') COMMENT 'event_time of the judged event.',
    evidence Nullable(String) COMMENT 'What matched, redacted (never the raw secret); for pii_leak the PII rules that matched.',
    INDEX idx_session_id session_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(event_time)
ORDER BY (evaluator, metric, policy_version, event_time, metric_id)
COMMENT 'Evaluator metrics, one row per metric_id after merges; read evaluation_metrics_latest.';

CREATE OR REPLACE VIEW {database}.evaluation_metrics_latest
AS SELECT * FROM {database}.evaluation_metrics FINAL;
