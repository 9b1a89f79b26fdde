-- resource_samples: GPU telemetry sampled through NVML by each worker (TREADLE_GPU_SAMPLE_SECONDS apart).
-- Read path: "GPU utilization while tool X ran" joins a tool call's [dispatched_at, result_at] interval with the
-- samples of that time (WHERE sampled_at BETWEEN ...), and charts per host/GPU over time, hence ORDER BY
-- (sampled_at, host, gpu_uuid). sample_id is deterministic, so a replayed sample collapses to one row.
CREATE TABLE IF NOT EXISTS {database}.resource_samples
(
    sample_id String COMMENT 'host/gpu_uuid/sampled_at.',
    host LowCardinality(String) COMMENT 'Host name of the sampling worker.',
    gpu_index UInt16 COMMENT 'NVML device index on the host.',
    gpu_uuid LowCardinality(String) COMMENT 'NVML device UUID.',
    gpu_name LowCardinality(String) COMMENT 'Device model.',
    utilization Float64 COMMENT 'Busy fraction over NVML''s last sample period (0-1).',
    memory_used_bytes UInt64 COMMENT 'Device memory in use.',
    memory_total_bytes UInt64 COMMENT 'Device memory in total.',
    power_watts Nullable(Float64) COMMENT 'Power draw; NULL where not reported.',
    sampled_at DateTime64(6, 'UTC') COMMENT 'When the sample was taken.'
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(sampled_at)
ORDER BY (sampled_at, host, gpu_uuid, sample_id)
COMMENT 'GPU samples, one row per sample_id after merges; read resource_samples_latest.';

CREATE OR REPLACE VIEW {database}.resource_samples_latest
AS SELECT * FROM {database}.resource_samples FINAL;

-- gpu_utilization_during_tool_calls: for every finished tool call, the mean utilization and memory of every GPU
-- sampled while it ran (NULL-free: calls with no sample inside their interval are left out).
-- Plain view (not materialized): it joins two tables on a time range, which an insert trigger cannot see whole.
CREATE OR REPLACE VIEW {database}.gpu_utilization_during_tool_calls
AS SELECT
    t.session_id AS session_id,
    t.step AS step,
    t.tool AS tool,
    t.policy_version AS policy_version,
    t.latency_ms AS latency_ms,
    s.host AS host,
    s.gpu_uuid AS gpu_uuid,
    count() AS samples,
    avg(s.utilization) AS mean_utilization,
    avg(s.memory_used_bytes) AS mean_memory_used_bytes
FROM {database}.transitions_latest AS t
CROSS JOIN {database}.resource_samples_latest AS s
WHERE t.result_at IS NOT NULL AND s.sampled_at BETWEEN t.dispatched_at AND t.result_at
GROUP BY session_id, step, tool, policy_version, latency_ms, host, gpu_uuid;
