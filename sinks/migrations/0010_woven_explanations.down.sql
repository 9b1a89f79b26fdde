-- Back to 0004's woven_rewards_latest before its new columns go; transitions_latest is recreated after, so its
-- column list loses them too.
CREATE OR REPLACE VIEW {database}.woven_rewards_latest
AS SELECT
    w.session_id AS session_id,
    w.logical_event_id AS logical_event_id,
    max(w.revision) AS revision,
    argMax(w.episode_id, w.revision) AS episode_id,
    argMax(w.step, w.revision) AS step,
    argMax(w.value, w.revision) AS value,
    argMax(w.status, w.revision) AS status,
    argMax(w.fusion, w.revision) AS fusion,
    argMax(w.policy_version, w.revision) AS policy_version,
    argMax(w.components.event_id, w.revision) AS `components.event_id`,
    argMax(w.components.source, w.revision) AS `components.source`,
    argMax(w.components.name, w.revision) AS `components.name`,
    argMax(w.components.value, w.revision) AS `components.value`,
    argMax(w.components.confidence, w.revision) AS `components.confidence`,
    argMax(w.components.weight, w.revision) AS `components.weight`,
    argMax(w.components.annotator, w.revision) AS `components.annotator`,
    argMax(w.components.event_time, w.revision) AS `components.event_time`,
    argMax(w.woven_at, w.revision) AS woven_at
FROM {database}.woven_rewards AS w
GROUP BY w.session_id, w.logical_event_id;

ALTER TABLE {database}.woven_rewards
    DROP COLUMN IF EXISTS `components.contribution`,
    DROP COLUMN IF EXISTS `components.adjusted_value`,
    DROP COLUMN IF EXISTS `components.lateness_ms`,
    DROP COLUMN IF EXISTS `components.evidence`,
    DROP COLUMN IF EXISTS `components.imputed`,
    DROP COLUMN IF EXISTS reward_policy_version,
    DROP COLUMN IF EXISTS rules_fired,
    DROP COLUMN IF EXISTS `conflicts.a_event_id`,
    DROP COLUMN IF EXISTS `conflicts.b_event_id`,
    DROP COLUMN IF EXISTS `conflicts.a_value`,
    DROP COLUMN IF EXISTS `conflicts.b_value`,
    DROP COLUMN IF EXISTS `conflicts.difference`,
    DROP COLUMN IF EXISTS imputed;

ALTER TABLE {database}.transitions
    DROP COLUMN IF EXISTS `reward_components.contribution`,
    DROP COLUMN IF EXISTS `reward_components.adjusted_value`,
    DROP COLUMN IF EXISTS `reward_components.lateness_ms`,
    DROP COLUMN IF EXISTS `reward_components.evidence`,
    DROP COLUMN IF EXISTS `reward_components.imputed`;

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;
