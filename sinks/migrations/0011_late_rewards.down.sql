DROP VIEW IF EXISTS {database}.late_rewards_latest;
DROP TABLE IF EXISTS {database}.late_rewards;
