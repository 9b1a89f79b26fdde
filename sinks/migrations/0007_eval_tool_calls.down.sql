DROP VIEW IF EXISTS {database}.eval_tool_stats_hourly;
DROP VIEW IF EXISTS {database}.eval_tool_stats_hourly_mv;
DROP TABLE IF EXISTS {database}.eval_tool_stats_hourly_state;
DROP VIEW IF EXISTS {database}.eval_tool_calls;
