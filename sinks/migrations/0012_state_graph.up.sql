-- State graph history (processors/state_processor.py publishes one StateVersion per applied event).
-- Shaped around its two read paths (bench/state_bench.py measures both):
-- * "state at version V": every node interval is split into an immutable *open* row (state_nodes, written
--   when a version opens it) and an *end* row (state_node_ends, written when a later version closes it).
--   The state at V is the opens with from_ordinal <= V minus the ends with to_ordinal <= V: two primary-key
--   range reads of one session and a small hash anti-join, no merge of open and closed rows at read time and
--   no FINAL (a row a replay inserted twice is the same row twice; readers collapse it by node id).
-- * "nodes caused by tool X in the last N minutes": state_node_causes, a narrow copy of the opens that a tool
--   caused, sorted by (caused_by_tool, valid_from), reads only the matching granules, for one session or all
--   (measured: a few ms less than a projection of state_nodes). DISTINCT collapses replayed rows.
-- The state at a time T is the state at the last version at or before T, less nodes whose TTL passed by T.
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
COMMENT 'State-graph versions; a replay re-inserts identical rows, which collapse. Read state_versions_latest.';

CREATE TABLE IF NOT EXISTS {database}.state_nodes
(
    session_id String COMMENT 'Session.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval.',
    node_id String COMMENT 'Node id.',
    type LowCardinality(String) COMMENT 'Node type.',
    data_json String COMMENT 'Node data (canonical JSON).',
    valid_from DateTime64(6, 'UTC') COMMENT 'Version time that opened it.',
    expires_at Nullable(DateTime64(6, 'UTC')) COMMENT 'TTL expiry, if any.',
    caused_by_tool LowCardinality(String) COMMENT 'Tool of the step whose action created this content, or empty.',
    open_op LowCardinality(String) COMMENT 'How it opened: upsert, or restore (a rollback).',
    INDEX idx_valid_from valid_from TYPE minmax GRANULARITY 1
)
ENGINE = ReplacingMergeTree
ORDER BY (session_id, from_ordinal, node_id)
COMMENT 'Node content intervals as opened (immutable); their ends are in state_node_ends. See state_node_intervals.';

CREATE TABLE IF NOT EXISTS {database}.state_node_causes
(
    caused_by_tool LowCardinality(String) COMMENT 'Tool of the step whose action created this content.',
    valid_from DateTime64(6, 'UTC') COMMENT 'Version time that opened the interval.',
    session_id String COMMENT 'Session.',
    node_id String COMMENT 'Node id.',
    type LowCardinality(String) COMMENT 'Node type.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval (joins state_nodes).'
)
ENGINE = ReplacingMergeTree
ORDER BY (caused_by_tool, valid_from, session_id, node_id, from_ordinal)
COMMENT 'Node intervals a tool caused, by tool and time: "nodes caused by tool X in the last N minutes".';

CREATE TABLE IF NOT EXISTS {database}.state_node_ends
(
    session_id String COMMENT 'Session.',
    to_ordinal UInt64 COMMENT 'Version that closed the interval.',
    node_id String COMMENT 'Node id.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval (joins state_nodes).',
    valid_to DateTime64(6, 'UTC') COMMENT 'Version time that closed it, or its TTL expiry if earlier.',
    close_op LowCardinality(String) COMMENT 'How it closed: upsert, delete, expire or restore.'
)
ENGINE = ReplacingMergeTree
ORDER BY (session_id, to_ordinal, node_id)
COMMENT 'Ends of node intervals.';

CREATE TABLE IF NOT EXISTS {database}.state_edges
(
    session_id String COMMENT 'Session.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval.',
    src String COMMENT 'Source node id.',
    dst String COMMENT 'Destination node id.',
    type LowCardinality(String) COMMENT 'causes, references, temporally_follows or a custom type.',
    data_json String COMMENT 'Edge data (canonical JSON).',
    valid_from DateTime64(6, 'UTC') COMMENT 'Version time that opened it.',
    open_op LowCardinality(String) COMMENT 'upsert or restore.'
)
ENGINE = ReplacingMergeTree
ORDER BY (session_id, from_ordinal, src, dst, type)
COMMENT 'Edge intervals as opened (immutable); their ends are in state_edge_ends. See state_edge_intervals.';

CREATE TABLE IF NOT EXISTS {database}.state_edge_ends
(
    session_id String COMMENT 'Session.',
    to_ordinal UInt64 COMMENT 'Version that closed the interval.',
    src String COMMENT 'Source node id.',
    dst String COMMENT 'Destination node id.',
    type LowCardinality(String) COMMENT 'Edge type.',
    from_ordinal UInt64 COMMENT 'Version that opened the interval (joins state_edges).',
    valid_to DateTime64(6, 'UTC') COMMENT 'Version time that closed it.',
    close_op LowCardinality(String) COMMENT 'upsert, delete or restore.'
)
ENGINE = ReplacingMergeTree
ORDER BY (session_id, to_ordinal, src, dst, type)
COMMENT 'Ends of edge intervals.';

CREATE OR REPLACE VIEW {database}.state_versions_latest AS SELECT * FROM {database}.state_versions FINAL;
CREATE OR REPLACE VIEW {database}.state_nodes_latest AS SELECT * FROM {database}.state_nodes FINAL;
CREATE OR REPLACE VIEW {database}.state_node_causes_latest AS SELECT * FROM {database}.state_node_causes FINAL;
CREATE OR REPLACE VIEW {database}.state_node_ends_latest AS SELECT * FROM {database}.state_node_ends FINAL;
CREATE OR REPLACE VIEW {database}.state_edges_latest AS SELECT * FROM {database}.state_edges FINAL;
CREATE OR REPLACE VIEW {database}.state_edge_ends_latest AS SELECT * FROM {database}.state_edge_ends FINAL;

-- One row per interval with its end (to_ordinal 18446744073709551615 and valid_to 2299-12-31, or the TTL
-- expiry, while open): for ad hoc SQL. The fast paths read the two tables directly (streams/state_history.py).
CREATE OR REPLACE VIEW {database}.state_node_intervals AS
SELECT
    n.session_id AS session_id, n.node_id AS node_id, n.from_ordinal AS from_ordinal,
    if(e.to_ordinal = 0, toUInt64(18446744073709551615), e.to_ordinal) AS to_ordinal,
    n.type AS type, n.data_json AS data_json, n.valid_from AS valid_from,
    if(e.to_ordinal = 0, ifNull(n.expires_at, toDateTime64('2299-12-31 23:59:59', 6, 'UTC')), e.valid_to) AS valid_to,
    n.expires_at AS expires_at, n.caused_by_tool AS caused_by_tool, n.open_op AS open_op, e.close_op AS close_op
FROM {database}.state_nodes AS n FINAL
LEFT JOIN (SELECT * FROM {database}.state_node_ends FINAL) AS e
    ON e.session_id = n.session_id AND e.node_id = n.node_id AND e.from_ordinal = n.from_ordinal
SETTINGS join_use_nulls = 0;

CREATE OR REPLACE VIEW {database}.state_edge_intervals AS
SELECT
    n.session_id AS session_id, n.src AS src, n.dst AS dst, n.type AS type, n.from_ordinal AS from_ordinal,
    if(e.to_ordinal = 0, toUInt64(18446744073709551615), e.to_ordinal) AS to_ordinal,
    n.data_json AS data_json, n.valid_from AS valid_from,
    if(e.to_ordinal = 0, toDateTime64('2299-12-31 23:59:59', 6, 'UTC'), e.valid_to) AS valid_to,
    n.open_op AS open_op, e.close_op AS close_op
FROM {database}.state_edges AS n FINAL
LEFT JOIN (SELECT * FROM {database}.state_edge_ends FINAL) AS e
    ON e.session_id = n.session_id AND e.src = n.src AND e.dst = n.dst AND e.type = n.type
    AND e.from_ordinal = n.from_ordinal
SETTINGS join_use_nulls = 0;
