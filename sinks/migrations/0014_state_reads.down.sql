ALTER TABLE {database}.state_edge_ends
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_edges
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_node_ends
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_node_causes
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_nodes
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_versions
    RESET SETTING min_age_to_force_merge_seconds, min_age_to_force_merge_on_partition_only;
ALTER TABLE {database}.state_edges
    MODIFY COLUMN src String COMMENT 'Source node id.',
    MODIFY COLUMN data_json String COMMENT 'Edge data (canonical JSON).';
ALTER TABLE {database}.state_edge_ends MODIFY COLUMN session_id String COMMENT 'Session.';
ALTER TABLE {database}.state_edges MODIFY COLUMN session_id String COMMENT 'Session.';
ALTER TABLE {database}.state_node_ends MODIFY COLUMN session_id String COMMENT 'Session.';
ALTER TABLE {database}.state_node_causes MODIFY COLUMN session_id String COMMENT 'Session.';
ALTER TABLE {database}.state_nodes MODIFY COLUMN session_id String COMMENT 'Session.';
ALTER TABLE {database}.state_versions MODIFY COLUMN session_id String COMMENT 'Session whose state this is.';
