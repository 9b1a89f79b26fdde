DROP VIEW IF EXISTS {database}.scheduler_advice_latest;
DROP TABLE IF EXISTS {database}.scheduler_advice;
