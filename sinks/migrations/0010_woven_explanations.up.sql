-- woven explanations: how each woven reward was made, next to the reward itself (issue 3, item 5). Per component:
-- its contribution to the value, its value after the fusion rules, lateness, evidence and whether it was imputed;
-- per reward: the reward policy version, the fusion rules fired (in order), conflicts between sources and the
-- imputed sources. `treadle explain <logical_event_id>` reads these columns.
-- The components are Nested, so each new sub-column is an Array column; rows written before this migration read
-- arrays of defaults of the right length (0, NULL, 0, NULL, false). transitions.reward_components holds the same
-- RewardComponent records, so it gets the same sub-columns. The two *_latest views are recreated because a view's
-- column list is fixed when it is created.
ALTER TABLE {database}.woven_rewards
    ADD COLUMN IF NOT EXISTS `components.contribution` Array(Float64)
        COMMENT 'Share of the fused value (weight x adjusted value; 0 when overridden).' AFTER `components.event_time`,
    ADD COLUMN IF NOT EXISTS `components.adjusted_value` Array(Nullable(Float64))
        COMMENT 'Value after the scale/override rules; NULL in rows written before fusion rules (read: value).'
        AFTER `components.contribution`,
    ADD COLUMN IF NOT EXISTS `components.lateness_ms` Array(Int64)
        COMMENT 'How late after its window the component arrived (0: on time).' AFTER `components.adjusted_value`,
    ADD COLUMN IF NOT EXISTS `components.evidence` Array(Nullable(String))
        COMMENT 'Evidence reference or text of the reward signal.' AFTER `components.lateness_ms`,
    ADD COLUMN IF NOT EXISTS `components.imputed` Array(Bool)
        COMMENT 'Imputed by the reward policy instead of received.' AFTER `components.evidence`,
    ADD COLUMN IF NOT EXISTS reward_policy_version LowCardinality(String)
        COMMENT 'Reward policy (specs and fusion rules) version used.' AFTER woven_at,
    ADD COLUMN IF NOT EXISTS rules_fired Array(LowCardinality(String))
        COMMENT 'Fusion rules that matched a component, in application order.' AFTER reward_policy_version,
    ADD COLUMN IF NOT EXISTS `conflicts.a_event_id` Array(String)
        COMMENT 'Conflicting pairs: event_id of the first component.' AFTER rules_fired,
    ADD COLUMN IF NOT EXISTS `conflicts.b_event_id` Array(String)
        COMMENT 'Conflicting pairs: event_id of the second component.' AFTER `conflicts.a_event_id`,
    ADD COLUMN IF NOT EXISTS `conflicts.a_value` Array(Float64)
        COMMENT 'Conflicting pairs: post-rule value of the first component.' AFTER `conflicts.b_event_id`,
    ADD COLUMN IF NOT EXISTS `conflicts.b_value` Array(Float64)
        COMMENT 'Conflicting pairs: post-rule value of the second component.' AFTER `conflicts.a_value`,
    ADD COLUMN IF NOT EXISTS `conflicts.difference` Array(Float64)
        COMMENT 'Conflicting pairs: absolute difference of the two values.' AFTER `conflicts.b_value`,
    ADD COLUMN IF NOT EXISTS imputed Array(LowCardinality(String))
        COMMENT 'Sources whose component was imputed.' AFTER `conflicts.difference`;

ALTER TABLE {database}.transitions
    ADD COLUMN IF NOT EXISTS `reward_components.contribution` Array(Float64)
        COMMENT 'Share of the fused reward (weight x adjusted value; 0 when overridden).'
        AFTER `reward_components.event_time`,
    ADD COLUMN IF NOT EXISTS `reward_components.adjusted_value` Array(Nullable(Float64))
        COMMENT 'Value after the scale/override rules; NULL in rows written before fusion rules (read: value).'
        AFTER `reward_components.contribution`,
    ADD COLUMN IF NOT EXISTS `reward_components.lateness_ms` Array(Int64)
        COMMENT 'How late after its window the component arrived (0: on time).' AFTER `reward_components.adjusted_value`,
    ADD COLUMN IF NOT EXISTS `reward_components.evidence` Array(Nullable(String))
        COMMENT 'Evidence reference or text of the reward signal.' AFTER `reward_components.lateness_ms`,
    ADD COLUMN IF NOT EXISTS `reward_components.imputed` Array(Bool)
        COMMENT 'Imputed by the reward policy instead of received.' AFTER `reward_components.evidence`;

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;

-- As in 0004, columns are qualified with w. because ClickHouse aliases are global.
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
    argMax(w.components.contribution, w.revision) AS `components.contribution`,
    argMax(w.components.adjusted_value, w.revision) AS `components.adjusted_value`,
    argMax(w.components.lateness_ms, w.revision) AS `components.lateness_ms`,
    argMax(w.components.evidence, w.revision) AS `components.evidence`,
    argMax(w.components.imputed, w.revision) AS `components.imputed`,
    argMax(w.woven_at, w.revision) AS woven_at,
    argMax(w.reward_policy_version, w.revision) AS reward_policy_version,
    argMax(w.rules_fired, w.revision) AS rules_fired,
    argMax(w.conflicts.a_event_id, w.revision) AS `conflicts.a_event_id`,
    argMax(w.conflicts.b_event_id, w.revision) AS `conflicts.b_event_id`,
    argMax(w.conflicts.a_value, w.revision) AS `conflicts.a_value`,
    argMax(w.conflicts.b_value, w.revision) AS `conflicts.b_value`,
    argMax(w.conflicts.difference, w.revision) AS `conflicts.difference`,
    argMax(w.imputed, w.revision) AS imputed
FROM {database}.woven_rewards AS w
GROUP BY w.session_id, w.logical_event_id;
