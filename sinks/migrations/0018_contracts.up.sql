-- contract_checks: one row per (step, contract, phase) the contracts processor checked: passed, violated or
-- not_evaluable, the first failing clause and the values the clauses saw. check_id is deterministic (session, step,
-- contract, phase), so a replay after a crash writes the same key and ReplacingMergeTree keeps one row.
-- Read path: "violations of contract X lately" (WHERE contract = ? AND outcome = ? AND event_time > ?) and "the
-- checks of step S" (WHERE logical_event_id = ?, helped by a bloom-filter index).
CREATE TABLE IF NOT EXISTS {database}.contract_checks
(
    check_id String COMMENT 'Deterministic id: session, step, contract and phase.',
    session_id String COMMENT 'Session of the step.',
    episode_id String COMMENT 'Episode of the step.',
    logical_event_id String COMMENT 'The step checked.',
    step Nullable(Int64) COMMENT 'Step index.',
    tool LowCardinality(String) COMMENT 'Tool of the step.',
    contract LowCardinality(String) COMMENT 'Contract name.',
    contract_version Int64 COMMENT 'Contract version used (newest effective at the dispatch).',
    phase LowCardinality(String) COMMENT 'pre (preconditions and parameter constraints) or post (postconditions).',
    outcome LowCardinality(String) COMMENT 'passed, violated or not_evaluable.',
    clause Nullable(String) COMMENT 'First violated (else not evaluable) clause.',
    failed_clauses Array(String) COMMENT 'Every violated or not evaluable clause.',
    reason Nullable(String) COMMENT 'Why the first clause could not be evaluated.',
    values_json String COMMENT 'What the clauses saw: params, the nodes they name, versions, result (JSON).',
    state_version_id String COMMENT 'State version evaluated (acted on for pre, after the result for post).',
    source_event_id String COMMENT 'event_id of the dispatch (pre) or tool result (post).',
    event_time DateTime64(6, 'UTC') COMMENT 'Version time of the state version evaluated.',
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(event_time)
ORDER BY (contract, outcome, event_time, check_id)
COMMENT 'Contract checks, one row per check_id after merges; read contract_checks_latest.';

CREATE OR REPLACE VIEW {database}.contract_checks_latest
AS SELECT * FROM {database}.contract_checks FINAL;

-- step_evidence: provenance, one row per dispatch or tool result: the SHA-256 of its bytes as received and its
-- envelope attributes (executor host, tool version). `treadle provenance STEP --verify` recomputes the hash from
-- raw_events. Keyed by event_id, so a replay rewrites the same row.
CREATE TABLE IF NOT EXISTS {database}.step_evidence
(
    event_id String COMMENT 'The hashed event.',
    session_id String COMMENT 'Session of the event.',
    episode_id String COMMENT 'Episode of the event.',
    logical_event_id String COMMENT 'Step of the event.',
    schema_name LowCardinality(String) COMMENT 'Avro record name of the event.',
    tool LowCardinality(String) COMMENT 'Tool of the dispatch or result.',
    sha256 String COMMENT 'Hex SHA-256 of the Kafka value bytes as received.',
    size_bytes Int64 COMMENT 'Length of those bytes.',
    attributes Map(LowCardinality(String), String) COMMENT 'Envelope attributes of the event.',
    event_time DateTime64(6, 'UTC') COMMENT 'event_time of the event.',
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(event_time)
ORDER BY (session_id, event_id)
COMMENT 'Hashes of step events as received, one row per event_id after merges; read step_evidence_latest.';

CREATE OR REPLACE VIEW {database}.step_evidence_latest
AS SELECT * FROM {database}.step_evidence FINAL;
