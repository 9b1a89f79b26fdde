-- Tool evaluation: success rate and latency percentiles per tool, agent_id and policy_version.
-- Source: the raw ToolResult events, not transitions. Every call counts (a retried step has several results, each
-- one cost time and money), and a ToolResult never changes once emitted (event_id is its identity), whereas a
-- transition is revised (the NULL tool_status of revision 1 becomes OK in revision 2): a materialized view over
-- transitions sees every revision and cannot take back what an older one added, so it could never be exact.
--
-- eval_tool_calls (plain view): one row per tool result, typed out of raw_events_latest.payload_json.
--   Read path: any time range and any grouping, aggregated at query time; exact, because raw_events_latest reads
--   FINAL, so a tool result re-inserted by a sink replay counts once. The percentile definition is ClickHouse's
--   quantileExact: the value at 0-based index floor(q * n) of the sorted latencies (the max for q = 1).
--     SELECT tool, agent_id, policy_version, count() AS calls, avg(status = 'OK') AS success_rate,
--            quantilesExact(0.5, 0.95, 0.99)(latency_ms) AS p50_p95_p99
--     FROM eval_tool_calls WHERE event_time >= now() - INTERVAL 1 DAY AND policy_version IN ('v7', 'v8')
--     GROUP BY tool, agent_id, policy_version
--   It parses JSON and merges raw_events at read time: exact at any granularity, slower on a long history.
--
-- eval_tool_stats_hourly_state (AggregatingMergeTree) + eval_tool_stats_hourly_mv (materialized view on inserts
--   into raw_events): the fast path for dashboards, one row per (policy_version, tool, agent_id, hour).
--   Exact under replays because its only state is a *set*: groupUniqArray of (event_id, status, latency_ms). A sink
--   replay inserts the same tool result again, the view adds the same tuple again, and the set keeps it once (sum
--   or count states would count it twice, and the rows arrive before FINAL could remove them). Counts and
--   percentiles are computed from the set when read, so they are the same numbers as eval_tool_calls gives for
--   the same whole hours. The price: the state keeps one tuple per call, like the raw table (bytes, not rows).
--   The backfill INSERT below covers events that landed before this migration; a tool result inserted while it
--   runs is seen by both the view and the backfill, which the set absorbs as well.
--   Time filters have hour granularity here (WHERE hour >= ...); for arbitrary bounds read eval_tool_calls.
-- eval_tool_stats_hourly (plain view): the state merged into numbers. Re-aggregate other groupings from the state
--   table with groupUniqArrayMerge(samples), never by averaging the hourly rates.
CREATE OR REPLACE VIEW {database}.eval_tool_calls
AS SELECT
    r.event_time AS event_time,
    r.policy_version AS policy_version,
    r.agent_id AS agent_id,
    JSONExtractString(r.payload_json, 'tool') AS tool,
    JSONExtractString(r.payload_json, 'status') AS status,
    JSONExtractFloat(r.payload_json, 'latency_ms') AS latency_ms,
    JSONExtractFloat(r.payload_json, 'cost_usd') AS cost_usd,
    JSONExtractInt(r.payload_json, 'tokens_in') AS tokens_in,
    JSONExtractInt(r.payload_json, 'tokens_out') AS tokens_out,
    JSONExtractInt(r.payload_json, 'retries') AS retries,
    r.session_id AS session_id,
    r.episode_id AS episode_id,
    r.logical_event_id AS logical_event_id,
    r.event_id AS event_id
FROM {database}.raw_events_latest AS r
WHERE r.kind = 'tool_results';

CREATE TABLE IF NOT EXISTS {database}.eval_tool_stats_hourly_state
(
    hour DateTime('UTC') COMMENT 'Start of the UTC hour of the tool results'' event_time.',
    tool LowCardinality(String) COMMENT 'Tool called.',
    agent_id LowCardinality(String) COMMENT 'Agent that called it.',
    policy_version LowCardinality(String) COMMENT 'Policy version in the tool result''s envelope.',
    samples AggregateFunction(groupUniqArray, Tuple(String, String, Float64))
        COMMENT 'Set of (event_id, status, latency_ms), one per tool result; read with groupUniqArrayMerge.'
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(hour)
ORDER BY (policy_version, tool, agent_id, hour)
COMMENT 'Hourly tool-call state fed by eval_tool_stats_hourly_mv; read eval_tool_stats_hourly.';

CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.eval_tool_stats_hourly_mv
TO {database}.eval_tool_stats_hourly_state
AS SELECT
    toStartOfHour(r.event_time) AS hour,
    JSONExtractString(r.payload_json, 'tool') AS tool,
    r.agent_id AS agent_id,
    r.policy_version AS policy_version,
    groupUniqArrayState(tuple(
        r.event_id, JSONExtractString(r.payload_json, 'status'), JSONExtractFloat(r.payload_json, 'latency_ms')
    )) AS samples
FROM {database}.raw_events AS r
WHERE r.kind = 'tool_results'
GROUP BY hour, tool, agent_id, policy_version;

INSERT INTO {database}.eval_tool_stats_hourly_state
SELECT
    toStartOfHour(r.event_time) AS hour,
    JSONExtractString(r.payload_json, 'tool') AS tool,
    r.agent_id AS agent_id,
    r.policy_version AS policy_version,
    groupUniqArrayState(tuple(
        r.event_id, JSONExtractString(r.payload_json, 'status'), JSONExtractFloat(r.payload_json, 'latency_ms')
    )) AS samples
FROM {database}.raw_events AS r
WHERE r.kind = 'tool_results'
GROUP BY hour, tool, agent_id, policy_version;

CREATE OR REPLACE VIEW {database}.eval_tool_stats_hourly
AS SELECT
    g.hour AS hour,
    g.tool AS tool,
    g.agent_id AS agent_id,
    g.policy_version AS policy_version,
    length(g.sample_set) AS calls,
    arrayCount(c -> c.2 = 'OK', g.sample_set) AS ok,
    arrayCount(c -> c.2 = 'ERROR', g.sample_set) AS errors,
    arrayCount(c -> c.2 = 'TIMEOUT', g.sample_set) AS timeouts,
    arrayCount(c -> c.2 = 'REJECTED', g.sample_set) AS rejected,
    ok / calls AS success_rate,
    arrayReduce('quantileExact(0.5)', arrayMap(c -> c.3, g.sample_set)) AS latency_p50_ms,
    arrayReduce('quantileExact(0.95)', arrayMap(c -> c.3, g.sample_set)) AS latency_p95_ms,
    arrayReduce('quantileExact(0.99)', arrayMap(c -> c.3, g.sample_set)) AS latency_p99_ms
FROM
(
    SELECT s.hour AS hour, s.tool AS tool, s.agent_id AS agent_id, s.policy_version AS policy_version,
        groupUniqArrayMerge(s.samples) AS sample_set
    FROM {database}.eval_tool_stats_hourly_state AS s
    GROUP BY s.hour, s.tool, s.agent_id, s.policy_version
) AS g;
