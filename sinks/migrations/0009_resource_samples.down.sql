DROP VIEW IF EXISTS {database}.gpu_utilization_during_tool_calls;
DROP VIEW IF EXISTS {database}.resource_samples_latest;
DROP TABLE IF EXISTS {database}.resource_samples;
