-- Faster state-graph reads (issue #4; bench/state_bench.py measures both read paths).
-- * Edges are read whole for "state at version V", and src and data_json repeat (an action causes many nodes;
--   most edges carry `{}`): stored as LowCardinality, they leave the table as Arrow dictionaries with no
--   toLowCardinality at read time (measured on chDB: the edges read 24.9 -> 19.1 ms at 110,000 edges).
-- * Every part of a table is one more range to read, hash and hand over for one session: at 100,000 nodes, one
--   part instead of three made "state at V" about 6 ms faster and "caused by tool X" about 2 ms. Once a table
--   has had no insert for min_age_to_force_merge_seconds, its parts are merged into one (on_partition_only:
--   only when *every* part is that old, so a sink that keeps inserting never triggers it and normal merges
--   apply). The cost: each quiet spell after writes rewrites the table once (cheap for the embedded store;
--   with very large tables on a server, reset these two settings).
-- * Every read filters one session, and the primary key range alone does not spare ClickHouse comparing
--   session_id row by row: as LowCardinality that is a comparison of small integers (measured on chDB at
--   100,000 nodes: the nodes read -8 ms, the pair -14 ms, caused by tool X -2.5 ms, in one run under load 6.7).
--   The tables are sorted by session first, so a granule holds few sessions even when there are many.
ALTER TABLE {database}.state_edges
    MODIFY COLUMN src LowCardinality(String) COMMENT 'Source node id.',
    MODIFY COLUMN data_json LowCardinality(String) COMMENT 'Edge data (canonical JSON).';
ALTER TABLE {database}.state_versions
    MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session whose state this is.';
ALTER TABLE {database}.state_nodes MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session.';
ALTER TABLE {database}.state_node_causes MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session.';
ALTER TABLE {database}.state_node_ends MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session.';
ALTER TABLE {database}.state_edges MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session.';
ALTER TABLE {database}.state_edge_ends MODIFY COLUMN session_id LowCardinality(String) COMMENT 'Session.';

ALTER TABLE {database}.state_versions
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
ALTER TABLE {database}.state_nodes
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
ALTER TABLE {database}.state_node_causes
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
ALTER TABLE {database}.state_node_ends
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
ALTER TABLE {database}.state_edges
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
ALTER TABLE {database}.state_edge_ends
    MODIFY SETTING min_age_to_force_merge_seconds = 10, min_age_to_force_merge_on_partition_only = 1;
