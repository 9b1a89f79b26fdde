DROP VIEW IF EXISTS {database}.eval_preference_win_rate;
DROP VIEW IF EXISTS {database}.eval_preferences;
DROP VIEW IF EXISTS {database}.eval_safety_episodes;
DROP VIEW IF EXISTS {database}.eval_safety_alerts_hourly;
DROP VIEW IF EXISTS {database}.eval_safety_alerts;
DROP VIEW IF EXISTS {database}.eval_episodes;
