DROP VIEW IF EXISTS {database}.reward_components_latest;
DROP TABLE IF EXISTS {database}.reward_components;
