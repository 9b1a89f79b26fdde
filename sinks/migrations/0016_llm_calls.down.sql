DROP VIEW IF EXISTS {database}.llm_calls_latest;
DROP TABLE IF EXISTS {database}.llm_calls;
