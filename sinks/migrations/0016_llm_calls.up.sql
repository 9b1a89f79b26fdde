-- llm_calls: every model call an agent recorded (SDK `AgentStream.llm_call`), one row per (session_id, event_id).
-- What the model saw and said, linked to its step by logical_event_id: the prompt/completion half of a training
-- triplet, whose reward half is the step's row in transitions_latest (join on session_id, logical_event_id;
-- `treadle export --shape triplets` does that join).
-- LLM calls land here only, not in raw_events: their token arrays would double the largest rows for no reader.
-- Token ids and logprobs are arrays (UInt32 / Float32), as on the wire; the long text and array columns are
-- ZSTD-compressed. There is no `variant` column: a call is an input, the same in every re-woven variant.
-- Read path: "the calls of step S" (WHERE session_id = ? AND logical_event_id = ?, the sort key's prefix), and a
-- trainer's scan by time/model/policy (event_time is the partition key). llm_calls_latest reads with FINAL.
CREATE TABLE IF NOT EXISTS {database}.llm_calls
(
    event_id String COMMENT 'UUIDv7 of the LlmCall event; the idempotency key.',
    session_id String COMMENT 'Agent session; the Kafka partition key.',
    logical_event_id String COMMENT 'The step the call belongs to.',
    agent_id LowCardinality(String) COMMENT 'Agent that made the call.',
    episode_id String COMMENT 'Episode of the step.',
    seq Int64 COMMENT 'Per-session, per-producer sequence number.',
    event_time DateTime64(6, 'UTC') COMMENT 'When the call happened (the envelope event_time).',
    policy_version LowCardinality(String) COMMENT 'Policy that acted.',
    trace_id String COMMENT 'Trace id of the step.',
    attributes Map(LowCardinality(String), String) COMMENT 'Free-form string tags from the envelope.',
    provider LowCardinality(String) COMMENT 'Who served the model (openai, vllm, ...).',
    model LowCardinality(String) COMMENT 'Model name as the provider reported it.',
    request_id String COMMENT 'Client-side request id, or empty.',
    response_id String COMMENT 'Provider response id, or empty.',
    choice_index UInt32 COMMENT 'Which choice of the response this row is.',
    messages_json String CODEC(ZSTD(3)) COMMENT 'The chat request messages as JSON; empty for a text completion.',
    prompt_text String CODEC(ZSTD(3)) COMMENT 'The prompt as text (rendered template or text prompt), or empty.',
    completion_text String CODEC(ZSTD(3)) COMMENT 'The generated text of this choice.',
    tool_calls_json String CODEC(ZSTD(3)) COMMENT 'Tool calls the model asked for, as JSON; empty if none.',
    prompt_token_ids Array(UInt32) CODEC(ZSTD(3)) COMMENT 'Prompt token ids; empty if unknown.',
    completion_token_ids Array(UInt32) CODEC(ZSTD(3)) COMMENT 'Completion token ids; empty if unknown.',
    completion_logprobs Array(Float32) CODEC(ZSTD(3)) COMMENT 'Logprob of each completion token; empty if not requested.',
    finish_reason LowCardinality(String) COMMENT 'stop, length, tool_calls, content_filter, ...',
    prompt_tokens Int64 COMMENT 'Prompt tokens billed.',
    completion_tokens Int64 COMMENT 'Completion tokens billed.',
    cached_tokens Int64 COMMENT 'Prompt tokens served from the provider cache.',
    latency_ms Float64 COMMENT 'Duration of the call in milliseconds.',
    cost_usd Float64 COMMENT 'API cost in US dollars, if known.',
    temperature Nullable(Float64) COMMENT 'Sampling temperature; NULL if not set.',
    top_p Nullable(Float64) COMMENT 'Nucleus sampling top_p; NULL if not set.',
    seed Nullable(Int64) COMMENT 'Sampling seed; NULL if not set.',
    max_tokens Nullable(Int64) COMMENT 'Completion token limit; NULL if not set.',
    params_json String COMMENT 'Other request parameters as JSON; empty if none.',
    ingested_revision UInt32 COMMENT 'Revision of the sink row format; a replay through a newer mapper replaces older rows.'
)
ENGINE = ReplacingMergeTree(ingested_revision)
PARTITION BY toYYYYMM(event_time)
ORDER BY (session_id, logical_event_id, event_id)
COMMENT 'Model calls inside steps, one row per (session_id, event_id) after merges; read llm_calls_latest.';

CREATE OR REPLACE VIEW {database}.llm_calls_latest
AS SELECT * FROM {database}.llm_calls FINAL;
