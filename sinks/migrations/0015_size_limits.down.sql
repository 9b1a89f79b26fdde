DROP VIEW IF EXISTS {database}.rejected_rows_latest;
DROP TABLE IF EXISTS {database}.rejected_rows;

ALTER TABLE {database}.dead_letters DROP COLUMN IF EXISTS value_truncated_bytes;
ALTER TABLE {database}.transitions DROP COLUMN IF EXISTS truncated_bytes;

CREATE OR REPLACE VIEW {database}.dead_letters_latest
AS SELECT * FROM {database}.dead_letters FINAL;

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
