-- late_rewards: every reward that was not woven into its step, with why: AFTER_GRACE (its event_time is after its
-- source's window + grace from the dispatch), ORPHAN (no dispatch for its step within the orphan wait) or
-- ORPHAN_RESOLVED (an orphan whose dispatch came later, so it was woven after all; revision 2 replaces the ORPHAN row).
-- Read path: "late rewards by source over time" and "everything late for this session/step", hence the sort key;
-- late_rewards_latest gives the current verdict per reward.
CREATE TABLE IF NOT EXISTS {database}.late_rewards
(
    event_id String COMMENT 'event_id of the reward signal.',
    logical_event_id String COMMENT 'The step the reward judges.',
    session_id String COMMENT 'Session of the reward.',
    episode_id String COMMENT 'Episode of the reward.',
    agent_id LowCardinality(String) COMMENT 'Producer of the reward.',
    policy_version LowCardinality(String) COMMENT 'Agent policy version from the reward envelope.',
    source LowCardinality(String) COMMENT 'Reward source.',
    name LowCardinality(String) COMMENT 'Reward name within the source.',
    value Float64 COMMENT 'The reward value that was not woven.',
    confidence Float64 COMMENT 'The reward confidence.',
    annotator LowCardinality(String) COMMENT 'LLM, CODE or HUMAN.',
    reason LowCardinality(String) COMMENT 'AFTER_GRACE, ORPHAN or ORPHAN_RESOLVED.',
    detail String COMMENT 'The reason in words: window, grace and policy that applied.',
    lateness_ms Int64 COMMENT 'AFTER_GRACE: event_time - deadline; ORPHAN: the orphan wait; ORPHAN_RESOLVED: 0.',
    deadline DateTime64(6, 'UTC') COMMENT 'dispatch + window + grace, or event_time + orphan wait.',
    event_time DateTime64(6, 'UTC') COMMENT 'The reward event_time.',
    reward_policy_version LowCardinality(String) COMMENT 'Reward policy whose spec decided.',
    revision UInt32 COMMENT '1 for the first verdict, 2 once an orphan was resolved; the highest is current.',
    INDEX idx_logical_event_id logical_event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplacingMergeTree(revision)
PARTITION BY toYYYYMM(event_time)
ORDER BY (source, session_id, event_id)
COMMENT 'Rewards not woven into their step; read late_rewards_latest for the current verdict per reward.';

CREATE OR REPLACE VIEW {database}.late_rewards_latest
AS SELECT * FROM {database}.late_rewards FINAL;
