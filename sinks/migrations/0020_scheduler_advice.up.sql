-- Self-diagnosis advice to the plans scheduler (treadle.events.SchedulerAdvice on plan_events, written by the
-- plan_diagnosis evaluator; docs/plans.md, "Self-diagnosis"): one row per advice_id.
CREATE TABLE IF NOT EXISTS {database}.scheduler_advice
(
    advice_id String COMMENT 'Deterministic id: evaluator, action, tool#params_hash and the triggering failure''s event_id.',
    action LowCardinality(String) COMMENT 'SKIP_RETRIES: a flagged subgoal goes to its fallback at its next failure.',
    tool String COMMENT 'Tool (or agent) the advice is about.',
    params_hash String COMMENT 'Hash of the canonical params JSON (processors.plans.symptoms.params_hash).',
    failures Int32 COMMENT 'Failures counted within the window when the advice was given.',
    window_s Float64 COMMENT 'The event-time window the failures were counted in.',
    reason String COMMENT 'Why, for a person.',
    evaluator LowCardinality(String) COMMENT 'The evaluator that gave it.',
    source_event_id String COMMENT 'event_id of the failure that crossed the threshold.',
    advised_at DateTime64(6, 'UTC') COMMENT 'Event time of that failure.',
    valid_until DateTime64(6, 'UTC') COMMENT 'Event time after which the advice no longer applies.'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(advised_at)
ORDER BY (tool, params_hash, advice_id)
COMMENT 'Self-diagnosis advice to the plans scheduler, one row per advice; read scheduler_advice_latest.';

CREATE OR REPLACE VIEW {database}.scheduler_advice_latest AS SELECT * FROM {database}.scheduler_advice FINAL;
