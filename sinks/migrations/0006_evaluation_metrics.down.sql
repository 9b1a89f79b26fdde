DROP VIEW IF EXISTS {database}.evaluation_metrics_latest;
DROP TABLE IF EXISTS {database}.evaluation_metrics;
