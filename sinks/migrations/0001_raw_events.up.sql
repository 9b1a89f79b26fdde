-- raw_events: every input event as it arrived, one row per event_id.
-- Read path: a session's history in order (WHERE session_id = ? ORDER BY event_id: UUIDv7 sorts by time), and
-- "every event of step S" (WHERE logical_event_id = ?, helped by a bloom-filter index).
-- Re-inserting an event (replay after a crash) is harmless: ReplacingMergeTree keeps one row per
-- (session_id, event_id), and raw_events_latest reads with FINAL so nobody meets a duplicate before a merge.
CREATE TABLE IF NOT EXISTS {database}.raw_events
(
    kind LowCardinality(String) COMMENT 'Topic kind: actions, tool_results, rewards, state_deltas or lifecycle.',
    schema_name LowCardinality(String) COMMENT 'Avro record name, e.g. treadle.events.ActionDispatched.',
    event_id String COMMENT 'UUIDv7 of the event; the idempotency key.',
    session_id String COMMENT 'Agent session; the Kafka partition key.',
    agent_id LowCardinality(String) COMMENT 'Agent or reward source that produced the event.',
    episode_id String COMMENT 'Episode within the session.',
    logical_event_id String COMMENT 'The step this event belongs to or judges.',
    seq Int64 COMMENT 'Per-session, per-producer sequence number.',
    event_time DateTime64(6, 'UTC') COMMENT 'When the event happened at its source.',
    policy_version LowCardinality(String) COMMENT 'Policy that acted.',
    trace_id String COMMENT 'Trace id shared by the events of one step.',
    attributes Map(LowCardinality(String), String) COMMENT 'Free-form string tags from the envelope.',
    payload_json String COMMENT 'The record without its envelope, as JSON (query it with JSONExtract*).',
    ingested_revision UInt32 COMMENT 'Revision of the sink row format; a replay through a newer mapper replaces older rows.',
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_event_id event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(ingested_revision)
PARTITION BY toYYYYMM(event_time)
ORDER BY (session_id, event_id)
COMMENT 'Every input event, one row per (session_id, event_id) after merges; read raw_events_latest.';

CREATE OR REPLACE VIEW {database}.raw_events_latest
AS SELECT * FROM {database}.raw_events FINAL;
