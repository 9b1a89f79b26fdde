DROP VIEW IF EXISTS {database}.state_edges_latest;
DROP VIEW IF EXISTS {database}.state_nodes_latest;
DROP VIEW IF EXISTS {database}.state_versions_latest;
DROP TABLE IF EXISTS {database}.state_edges;
DROP TABLE IF EXISTS {database}.state_nodes;
DROP TABLE IF EXISTS {database}.state_versions;
