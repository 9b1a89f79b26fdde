-- State graph history (processors/state_processor.py publishes one StateVersion per applied event).
-- state_versions: the chain of versions per session. Read path: a version by id or ordinal, or the latest
-- version at or before a time (WHERE session_id = ? AND event_time <= ? ORDER BY ordinal DESC LIMIT 1).
-- state_nodes / state_edges: one row per *interval* in which a node (edge) had one content: it opened at
-- from_ordinal / valid_from and closed at to_ordinal / valid_to (open: to_ordinal = 2^64-1). An interval is
-- first inserted open, then again closed; ReplacingMergeTree(closed) keeps the closed row, and the *_latest
-- views read with FINAL. So "state at version V" is one range query: from_ordinal <= V < to_ordinal, and
-- "state at time T": valid_from <= T < valid_to (valid_to of a TTL'd node is its expiry).
CREATE TABLE IF NOT EXISTS {database}.state_versions
(
    session_id String COMMENT 'Session whose state this is.',
    ordinal UInt64 COMMENT '1-based position in the session''s version chain.',
    version_id String COMMENT 'session.ordinal.hash, content-addressed from the parent id and the operations.',
    parent_id String COMMENT 'Previous version (session.0.genesis for the first).',
    kind LowCardinality(String) COMMENT 'delta, action (dispatch auto node) or result (tool result auto node).',
    event_id String COMMENT 'Input event applied.',
    seq Int64 COMMENT 'seq of that event (versions are applied in seq order).',
    logical_event_id String COMMENT 'Step of the event.',
    episode_id String COMMENT 'Episode of the event.',
    tool LowCardinality(String) COMMENT 'Tool of the step that caused the change, or empty.',
    step Nullable(Int64) COMMENT 'Step index, for dispatch versions.',
    event_time DateTime64(6, 'UTC') COMMENT 'Version time: largest event_time applied so far (monotonic).',
    rollback_to Nullable(String) COMMENT 'Version restored before the delta''s operations.',
    late UInt8 COMMENT '1 when the event arrived after later-seq events and was applied at the head.',
    node_count UInt64 COMMENT 'Live nodes after this version.',
    edge_count UInt64 COMMENT 'Live edges after this version.',
    node_changes UInt32 COMMENT 'Node intervals opened or closed by this version.',
    edge_changes UInt32 COMMENT 'Edge intervals opened or closed by this version.',
    INDEX idx_version_id version_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree
ORDER BY (session_id, ordinal, version_id)
COMMENT 'State-graph versions; a replay re-inserts identical rows, which collapse.';

CREATE TABLE IF NOT EXISTS {database}.state_nodes
(
    session_id String COMMENT 'Session.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval.',
    node_id String COMMENT 'Node id.',
    to_ordinal UInt64 COMMENT 'Version that closed it (18446744073709551615 while open).',
    type LowCardinality(String) COMMENT 'Node type.',
    data_json String COMMENT 'Node data (canonical JSON).',
    valid_from DateTime64(6, 'UTC') COMMENT 'Version time that opened it.',
    valid_to DateTime64(6, 'UTC') COMMENT 'Version time that closed it, its TTL expiry, or 2299-12-31 while open.',
    expires_at Nullable(DateTime64(6, 'UTC')) COMMENT 'TTL expiry, if any.',
    caused_by_tool LowCardinality(String) COMMENT 'Tool of the step whose action created this content, or empty.',
    close_op LowCardinality(String) COMMENT 'How the interval closed: upsert, delete, expire, restore; empty while open.',
    closed UInt8 COMMENT '0: open row; 1: closed row (replaces the open one).',
    INDEX idx_tool caused_by_tool TYPE set(256) GRANULARITY 1,
    INDEX idx_valid_from valid_from TYPE minmax GRANULARITY 1,
    INDEX idx_node_id node_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(closed)
ORDER BY (session_id, from_ordinal, node_id)
COMMENT 'Node content intervals; read state_nodes_latest.';

CREATE TABLE IF NOT EXISTS {database}.state_edges
(
    session_id String COMMENT 'Session.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval.',
    src String COMMENT 'Source node id.',
    dst String COMMENT 'Destination node id.',
    type LowCardinality(String) COMMENT 'causes, references, temporally_follows or a custom type.',
    to_ordinal UInt64 COMMENT 'Version that closed it (18446744073709551615 while open).',
    data_json String COMMENT 'Edge data (canonical JSON).',
    valid_from DateTime64(6, 'UTC') COMMENT 'Version time that opened it.',
    valid_to DateTime64(6, 'UTC') COMMENT 'Version time that closed it, or 2299-12-31 while open.',
    close_op LowCardinality(String) COMMENT 'How the interval closed; empty while open.',
    closed UInt8 COMMENT '0: open row; 1: closed row (replaces the open one).'
)
ENGINE = ReplacingMergeTree(closed)
ORDER BY (session_id, from_ordinal, src, dst, type)
COMMENT 'Edge intervals; read state_edges_latest.';

CREATE OR REPLACE VIEW {database}.state_versions_latest AS SELECT * FROM {database}.state_versions FINAL;
CREATE OR REPLACE VIEW {database}.state_nodes_latest AS SELECT * FROM {database}.state_nodes FINAL;
CREATE OR REPLACE VIEW {database}.state_edges_latest AS SELECT * FROM {database}.state_edges FINAL;
