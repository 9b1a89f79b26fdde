DROP VIEW IF EXISTS {database}.woven_rewards_latest;
DROP TABLE IF EXISTS {database}.woven_rewards;
