DROP VIEW IF EXISTS {database}.plan_rewards;
DROP VIEW IF EXISTS {database}.plan_subgoal_rewards;
DROP VIEW IF EXISTS {database}.plan_step_reward_parts;
DROP VIEW IF EXISTS {database}.plan_step_rewards;
DROP VIEW IF EXISTS {database}.plan_steps_mv;
DROP TABLE IF EXISTS {database}.plan_steps;
