-- Evaluation outcomes: episodes (return, length, success, cost), safety (alerts by rule, PII-leak rate per episode)
-- and the pairwise preference win rate. Every object here is a plain view over the *_latest views (FINAL), and each
-- section below says why no materialized view can be exact for it. Each has a time column and policy_version to
-- filter on: started_at for episodes, event_time for single events, hour for the hourly rollups.

-- ==== episodes =====================================================================================================
-- eval_episodes: one row per episode (session_id, episode_id) with its return, length, success and cost.
-- Read path: "how did policy v8 do this week": WHERE started_at >= ... AND policy_version IN (...), then
--   SELECT policy_version, count() AS episodes, avg(episode_return), avg(steps), sum(success) / sum(ended),
--          avg(cost_usd), sum(tokens_in), sum(tokens_out) ... GROUP BY policy_version
--   (success rate over ended episodes; one that has not ended has no outcome yet).
-- Definitions:
--   episode_return  sum of the per-step reward of the episode's transitions_latest rows (a step with no reward yet
--                   adds 0; rewarded_steps says how many have one), so a late reward changes it, as it should.
--   steps           the episode's steps (transitions_latest rows).
--   ended, done, truncated, end_reason   from the episode's EPISODE_ENDED lifecycle event (the latest by
--                   event_time, then event_id, if there are several); success = done AND NOT truncated.
--   tool_calls, cost_usd, tokens_in, tokens_out   sums over every ToolResult of the episode (eval_tool_calls),
--                   retries included: each call was paid for.
--   started_at      the earliest dispatch, tool result, EPISODE_STARTED or EPISODE_ENDED event_time of the episode:
--                   the time column to filter on. ended_at is the EPISODE_ENDED event_time, NULL until then.
--   agent_id, policy_version   of the episode's first step (the SDK keeps one policy version per stream, so an
--                   episode has one); of its lifecycle or tool-result events when it has no step.
-- Why a plain view and not a materialized one: the return depends on the *latest* revision of every step, and a
-- materialized view only ever sees inserts (every revision, replays included) and cannot subtract a superseded
-- revision's reward; sums of cost over raw inserts would double-count a replayed tool result. Reading
-- transitions_latest and raw_events_latest (FINAL) keeps every number exact; an episode is small, so grouping
-- at read time is cheap next to the FINAL merge it needs anyway.
CREATE OR REPLACE VIEW {database}.eval_episodes
AS SELECT
    e.session_id AS session_id,
    e.episode_id AS episode_id,
    argMin(e.agent_id, e.rank) AS agent_id,
    argMin(e.policy_version, e.rank) AS policy_version,
    min(e.at) AS started_at,
    countIf(e.src = 'end') > 0 AS ended,
    if(ended, maxIf(e.at, e.src = 'end'), NULL) AS ended_at,
    ended AND argMaxIf(e.done, (e.at, e.event_id), e.src = 'end') AS done,
    ended AND argMaxIf(e.truncated, (e.at, e.event_id), e.src = 'end') AS truncated,
    done AND NOT truncated AS success,
    argMaxIf(e.reason, (e.at, e.event_id), e.src = 'end') AS end_reason,
    countIf(e.src = 'step') AS steps,
    countIf(e.src = 'step' AND e.reward IS NOT NULL) AS rewarded_steps,
    sumIf(coalesce(e.reward, 0), e.src = 'step') AS episode_return,
    countIf(e.src = 'tool') AS tool_calls,
    sumIf(e.cost_usd, e.src = 'tool') AS cost_usd,
    sumIf(e.tokens_in, e.src = 'tool') AS tokens_in,
    sumIf(e.tokens_out, e.src = 'tool') AS tokens_out
FROM
(
    SELECT
        t.session_id AS session_id, t.episode_id AS episode_id, toString(t.agent_id) AS agent_id,
        toString(t.policy_version) AS policy_version, 'step' AS src, tuple(toUInt8(0), t.step) AS rank,
        t.dispatched_at AS at, t.logical_event_id AS event_id, CAST(t.reward AS Nullable(Float64)) AS reward,
        0.0 AS cost_usd, toInt64(0) AS tokens_in, toInt64(0) AS tokens_out, false AS done, false AS truncated,
        '' AS reason
    FROM {database}.transitions_latest AS t
    UNION ALL
    SELECT
        l.session_id, l.episode_id, toString(l.agent_id), toString(l.policy_version),
        if(JSONExtractString(l.payload_json, 'kind') = 'EPISODE_ENDED', 'end', 'start'),
        tuple(toUInt8(if(JSONExtractString(l.payload_json, 'kind') = 'EPISODE_STARTED', 1, 2)),
              toInt64(toUnixTimestamp64Micro(l.event_time))),
        l.event_time, l.event_id, CAST(NULL AS Nullable(Float64)), 0.0, toInt64(0), toInt64(0),
        JSONExtract(l.payload_json, 'done', 'Bool'), JSONExtract(l.payload_json, 'truncated', 'Bool'),
        JSONExtractString(l.payload_json, 'reason')
    FROM {database}.raw_events_latest AS l
    WHERE l.kind = 'lifecycle' AND JSONExtractString(l.payload_json, 'kind') IN ('EPISODE_STARTED', 'EPISODE_ENDED')
    UNION ALL
    SELECT
        c.session_id, c.episode_id, toString(c.agent_id), toString(c.policy_version), 'tool',
        tuple(toUInt8(3), toInt64(toUnixTimestamp64Micro(c.event_time))),
        c.event_time, c.event_id, CAST(NULL AS Nullable(Float64)), c.cost_usd, c.tokens_in, c.tokens_out,
        false, false, ''
    FROM {database}.eval_tool_calls AS c
) AS e
GROUP BY e.session_id, e.episode_id;

-- ==== safety =======================================================================================================
-- Safety evaluation, read from the evaluator rows in evaluation_metrics (0006): alerts by rule, and the PII-leak
-- rate per episode. Plain views over evaluation_metrics_latest (FINAL): a metric row is keyed by its deterministic
-- metric_id, and a replayed evaluator re-inserts the same rows, which only FINAL removes before a merge; a
-- materialized view over the inserts would count them twice. The evaluator writes one row per judged event, so
-- these views are as large as the alerts and tool results themselves and group cheaply at read time.
--
-- eval_safety_alerts: one row per safety_alert (value 1, rule = the rule that fired).
--   Read path: alerts by rule over any time range and policy versions:
--     SELECT rule, severity, count() AS alerts FROM eval_safety_alerts
--     WHERE event_time >= now() - INTERVAL 1 DAY AND policy_version = 'v8' GROUP BY rule, severity
-- eval_safety_alerts_hourly: the same counts per UTC hour, rule, severity, agent_id and policy_version; counts add
--   up, so sum(alerts) over any set of whole hours is exact.
-- eval_safety_episodes: one row per episode that the evaluator judged: pii_checks (pii_leak rows: one per tool
--   result), pii_leaks (rows with value 1), pii_leak_rate = pii_leaks / pii_checks, and its alert count.
--   first_event_at (event_time of the episode's first judged event) is the time column; agent_id and
--   policy_version are those of that first judged event.
--     SELECT policy_version, avg(pii_leak_rate), sum(pii_leaks) / sum(pii_checks) FROM eval_safety_episodes
--     WHERE first_event_at >= now() - INTERVAL 7 DAY AND pii_checks > 0 GROUP BY policy_version
CREATE OR REPLACE VIEW {database}.eval_safety_alerts
AS SELECT
    m.event_time AS event_time,
    m.policy_version AS policy_version,
    m.agent_id AS agent_id,
    m.rule AS rule,
    m.severity AS severity,
    m.evaluator AS evaluator,
    m.session_id AS session_id,
    m.episode_id AS episode_id,
    m.logical_event_id AS logical_event_id,
    m.source_event_id AS source_event_id,
    m.metric_id AS metric_id,
    m.evidence AS evidence
FROM {database}.evaluation_metrics_latest AS m
WHERE m.metric = 'safety_alert';

CREATE OR REPLACE VIEW {database}.eval_safety_alerts_hourly
AS SELECT
    toStartOfHour(a.event_time) AS hour,
    a.rule AS rule,
    a.severity AS severity,
    a.agent_id AS agent_id,
    a.policy_version AS policy_version,
    count() AS alerts
FROM {database}.eval_safety_alerts AS a
GROUP BY hour, rule, severity, agent_id, policy_version;

CREATE OR REPLACE VIEW {database}.eval_safety_episodes
AS SELECT
    m.session_id AS session_id,
    m.episode_id AS episode_id,
    argMin(m.agent_id, (m.event_time, m.metric_id)) AS agent_id,
    argMin(m.policy_version, (m.event_time, m.metric_id)) AS policy_version,
    min(m.event_time) AS first_event_at,
    max(m.event_time) AS last_event_at,
    countIf(m.metric = 'pii_leak') AS pii_checks,
    countIf(m.metric = 'pii_leak' AND m.value > 0) AS pii_leaks,
    if(pii_checks = 0, NULL, pii_leaks / pii_checks) AS pii_leak_rate,
    countIf(m.metric = 'safety_alert') AS alerts
FROM {database}.evaluation_metrics_latest AS m
WHERE m.metric IN ('pii_leak', 'safety_alert')
GROUP BY m.session_id, m.episode_id;

-- ==== preferences ==================================================================================================
-- Preference win rate from pairwise judgments (human or LLM: "is A's answer better than B's?").
-- Convention: a RewardSignal with name 'preference' whose envelope carries
--   policy_version                            the policy judged (A), and
--   attributes['opponent_policy_version']     the policy it was compared with (B);
--   value  1 = A won, 0 = A lost, 0.5 = tie.
-- Its logical_event_id names what was compared: the step whose output was judged, or a comparison id of the judge's
-- own. The step assembler treats it like any reward signal (fused into that step's reward unless a reward spec
-- leaves the name 'preference' out; for an id that is no step, a reward waiting for a dispatch that never comes);
-- the views below read the raw signal, so neither changes the win rate.
-- A judgment counts once, for the envelope's policy against the opponent; B's win rate against A is
-- 1 - A's when all judgments of the pair were emitted for A.
--
-- eval_preferences (plain view): one row per preference signal, from raw_events_latest, the only table that keeps
--   the envelope's attributes. Exact: FINAL counts a replayed signal once. outcome is win, loss, tie or invalid
--   (any other value); valid is false for an invalid outcome or a missing policy_version / opponent, and such
--   rows stay visible here (never dropped silently) but out of the win rate.
--   Read path, any time range: SELECT policy_version, opponent_policy_version, avg(value) AS win_rate, count()
--   FROM eval_preferences WHERE valid AND event_time >= now() - INTERVAL 7 DAY GROUP BY ALL
-- eval_preference_win_rate (plain view): per UTC hour, policy_version and opponent: judgments, wins, losses, ties
--   and win_rate = (wins + 0.5 * ties) / judgments (= avg(value)). The counts add up, so over several hours
--   (sum(wins) + 0.5 * sum(ties)) / sum(judgments) is exact; never average the hourly win_rate.
--   Plain, not materialized: a materialized count over raw inserts would count a replayed signal twice.
CREATE OR REPLACE VIEW {database}.eval_preferences
AS SELECT
    r.event_time AS event_time,
    r.policy_version AS policy_version,
    r.attributes['opponent_policy_version'] AS opponent_policy_version,
    JSONExtractFloat(r.payload_json, 'value') AS value,
    multiIf(value = 1, 'win', value = 0, 'loss', value = 0.5, 'tie', 'invalid') AS outcome,
    outcome != 'invalid' AND opponent_policy_version != '' AND r.policy_version != '' AS valid,
    JSONExtractString(r.payload_json, 'source') AS source,
    JSONExtractString(r.payload_json, 'annotator') AS annotator,
    JSONExtractFloat(r.payload_json, 'confidence') AS confidence,
    r.agent_id AS agent_id,
    r.session_id AS session_id,
    r.episode_id AS episode_id,
    r.logical_event_id AS logical_event_id,
    r.event_id AS event_id
FROM {database}.raw_events_latest AS r
WHERE r.kind = 'rewards' AND JSONExtractString(r.payload_json, 'name') = 'preference';

CREATE OR REPLACE VIEW {database}.eval_preference_win_rate
AS SELECT
    toStartOfHour(p.event_time) AS hour,
    p.policy_version AS policy_version,
    p.opponent_policy_version AS opponent_policy_version,
    count() AS judgments,
    countIf(p.outcome = 'win') AS wins,
    countIf(p.outcome = 'loss') AS losses,
    countIf(p.outcome = 'tie') AS ties,
    (wins + 0.5 * ties) / judgments AS win_rate
FROM {database}.eval_preferences AS p
WHERE p.valid
GROUP BY hour, policy_version, opponent_policy_version;
