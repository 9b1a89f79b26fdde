-- size limits and rejected rows (issue 25): a dead letter or a transition cut to fit TREADLE_MAX_EVENT_BYTES says how
-- many bytes were cut; a record the sink cannot turn into a row, or whose row ClickHouse refuses, lands in
-- rejected_rows with the reason and where it came from, instead of stopping the sink. Views whose column list came
-- from these tables are recreated (a view's columns are fixed when it is created).
ALTER TABLE {database}.dead_letters
    ADD COLUMN IF NOT EXISTS value_truncated_bytes Int64 DEFAULT 0
        COMMENT 'Bytes cut from the end of value so the dead letter fit; 0: value is whole.';

ALTER TABLE {database}.transitions
    ADD COLUMN IF NOT EXISTS truncated_bytes Int64 DEFAULT 0
        COMMENT 'Bytes cut from output, params_json and error so the row fit; 0: nothing cut (raw_events is whole).';

CREATE OR REPLACE VIEW {database}.dead_letters_latest
AS SELECT * FROM {database}.dead_letters FINAL;

CREATE OR REPLACE VIEW {database}.transitions_latest
AS SELECT * FROM {database}.transitions FINAL;

CREATE TABLE IF NOT EXISTS {database}.rejected_rows
(
    rejected_id String COMMENT 'Deterministic id: source topic, partition and offset (and the table, for an insert).',
    stage LowCardinality(String) COMMENT 'MAP: the record could not become rows; INSERT: ClickHouse refused its row.',
    target_table LowCardinality(String) COMMENT 'Table the record was bound for.',
    reason String COMMENT 'Why, in one line.',
    topic LowCardinality(String) COMMENT 'Source topic.',
    partition Int32 COMMENT 'Source partition.',
    offset Int64 COMMENT 'Source offset.',
    value Nullable(String) COMMENT 'The record as it was on the topic (cut to 64 KiB; the whole one stays in Kafka).',
    rejected_at DateTime64(6, 'UTC') COMMENT 'Record timestamp of the source message (deterministic on replay).'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(rejected_at)
ORDER BY rejected_id
COMMENT 'Records the ClickHouse sink could not write; read rejected_rows_latest.';

CREATE OR REPLACE VIEW {database}.rejected_rows_latest
AS SELECT * FROM {database}.rejected_rows FINAL;

-- As in 0013: its t.* now includes truncated_bytes.
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
