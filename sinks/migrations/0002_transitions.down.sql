DROP VIEW IF EXISTS {database}.transitions_latest;
DROP TABLE IF EXISTS {database}.transitions;
