-- Back to 0016: every variant's rows go (they exist only beside the live ones), then variant leaves the sort keys
-- and the tables; the views are restored as 0010/0011/0003/0015 left them, before the column they read goes.
DROP VIEW IF EXISTS {database}.transitions_variants;
DROP VIEW IF EXISTS {database}.late_rewards_variants;
DROP VIEW IF EXISTS {database}.reward_components_variants;
DROP VIEW IF EXISTS {database}.woven_rewards_variants;

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;

CREATE OR REPLACE VIEW {database}.late_rewards_latest
AS SELECT * FROM {database}.late_rewards FINAL;

CREATE OR REPLACE VIEW {database}.reward_components_latest
AS SELECT * FROM {database}.reward_components FINAL;

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

ALTER TABLE {database}.transitions DELETE WHERE variant != 'live' SETTINGS mutations_sync = 2;
ALTER TABLE {database}.woven_rewards DELETE WHERE variant != 'live' SETTINGS mutations_sync = 2;
ALTER TABLE {database}.late_rewards DELETE WHERE variant != 'live' SETTINGS mutations_sync = 2;
ALTER TABLE {database}.reward_components DELETE WHERE variant != 'live' SETTINGS mutations_sync = 2;

ALTER TABLE {database}.transitions MODIFY ORDER BY (session_id, step, logical_event_id);
ALTER TABLE {database}.woven_rewards MODIFY ORDER BY (session_id, logical_event_id, revision);
ALTER TABLE {database}.late_rewards MODIFY ORDER BY (source, session_id, event_id);
ALTER TABLE {database}.reward_components MODIFY ORDER BY (session_id, logical_event_id, event_id);

ALTER TABLE {database}.transitions DROP COLUMN IF EXISTS variant;
ALTER TABLE {database}.woven_rewards DROP COLUMN IF EXISTS variant;
ALTER TABLE {database}.late_rewards DROP COLUMN IF EXISTS variant;
ALTER TABLE {database}.reward_components DROP COLUMN IF EXISTS variant;

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;

CREATE OR REPLACE VIEW {database}.transitions_with_state AS
SELECT
    t.*,
    if(vb.b_version = '', concat(t.session_id, '.0.genesis'), vb.b_version) AS state_before,
    if(va.a_version = '', concat(t.session_id, '.0.genesis'), va.a_version) AS state_after
FROM {database}.transitions_latest AS t
LEFT JOIN
(
    SELECT
        session_id AS d_session,
        logical_event_id AS d_lid,
        seq AS dispatch_seq,
        leadInFrame(seq, 1, toInt64(9223372036854775807))
            OVER (PARTITION BY session_id ORDER BY seq ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS next_dispatch_seq
    FROM {database}.raw_events FINAL
    WHERE kind = 'actions'
) AS d ON d.d_session = t.session_id AND d.d_lid = t.logical_event_id
ASOF LEFT JOIN
(
    SELECT session_id AS b_session, seq AS b_seq, version_id AS b_version FROM {database}.state_versions FINAL
) AS vb ON vb.b_session = t.session_id AND vb.b_seq < d.dispatch_seq
ASOF LEFT JOIN
(
    SELECT session_id AS a_session, seq AS a_seq, version_id AS a_version FROM {database}.state_versions FINAL
) AS va ON va.a_session = t.session_id AND va.a_seq < d.next_dispatch_seq;
