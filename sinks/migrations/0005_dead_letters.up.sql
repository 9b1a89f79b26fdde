-- dead_letters: inputs that could not be processed, with the stage, the reason and the raw bytes (String holds
-- arbitrary bytes: hex(value) shows them). The id is derived from topic, partition and offset, so a replay writes
-- the same key. Read path: recent failures by stage or topic; dead_letters_latest reads with FINAL.
CREATE TABLE IF NOT EXISTS {database}.dead_letters
(
    dead_letter_id String COMMENT 'Deterministic id: source topic, partition and offset.',
    stage LowCardinality(String) COMMENT 'DECODE, SCHEMA, VALIDATE or PROCESS.',
    reason String COMMENT 'Human-readable reason.',
    topic LowCardinality(String) COMMENT 'Source topic.',
    partition Int32 COMMENT 'Source partition.',
    offset Int64 COMMENT 'Source offset.',
    key Nullable(String) COMMENT 'Raw key bytes.',
    value Nullable(String) COMMENT 'Raw value bytes.',
    event_id Nullable(String) COMMENT 'event_id if the value could be decoded.',
    session_id Nullable(String) COMMENT 'session_id if known.',
    schema_name LowCardinality(Nullable(String)) COMMENT 'Writer schema name if known.',
    failed_at DateTime64(6, 'UTC') COMMENT 'Record timestamp of the source message (deterministic on replay).'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(failed_at)
ORDER BY dead_letter_id
COMMENT 'Inputs that could not be processed, one row per dead_letter_id after merges; read dead_letters_latest.';

CREATE OR REPLACE VIEW {database}.dead_letters_latest
AS SELECT * FROM {database}.dead_letters FINAL;
