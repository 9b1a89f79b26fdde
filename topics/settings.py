"""Configuration from the environment, with documented defaults.

Every knob lives here so the configuration page and the code cannot drift apart: each field's
description is the documentation (`configuration_markdown()` renders the page from it), and
`Settings.from_env()` is the only reader of os.environ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

_ENV_NAMES = {
    "kafka_bootstrap_servers": "KAFKA_BOOTSTRAP_SERVERS",
    "clickhouse_url": "CLICKHOUSE_URL",
    "redis_url": "REDIS_URL",
}
_LIST_FIELDS = {"processors", "gc_thresholds"}  # comma-separated in the environment

# Kafka's record limits, written out rather than left to each default so the producers, the topics and the local
# broker agree: a record the producer accepts is one the broker takes. These are Kafka's own defaults (the broker
# and topic limit is the producer's plus a 12-byte batch header allowance, as in Kafka).
KAFKA_MAX_REQUEST_BYTES = 1_048_576  # producer max_request_size (worker and SDK)
KAFKA_MAX_MESSAGE_BYTES = 1_048_588  # broker message.max.bytes and every topic's max.message.bytes
# How often a consumer (worker and sink) refreshes its cluster metadata, instead of aiokafka's 5 minutes: when a
# partition's leader moves (a broker restarted and the preferred leader took it back), aiokafka's offset reset for a
# partition without a committed offset retries the old leader on NotLeaderForPartitionError without refreshing, so a
# worker starting then stalled for up to 5 minutes (bench.chaos on a 3-broker cluster). One small request per 10 s.
CONSUMER_METADATA_MAX_AGE_MS = 10_000


def min_insync_replicas(replication_factor: int) -> int:
    """Replicas an acks=all write needs in sync: 2 of 3 (one broker may be down, an acknowledged record is on two);
    1 below 3 replicas, where 2 would stop writes whenever one broker is."""
    return 2 if replication_factor >= 3 else 1


def env_var(field: str) -> str:
    """The environment variable of a Settings field."""
    return _ENV_NAMES.get(field, f"TREADLE_{field.upper()}")


class InvalidSettingError(ValueError):
    """An environment variable treadle cannot use; the message names it, its value and why, in one line."""


class Settings(BaseModel):
    """treadle settings; the env var is the upper-cased field name prefixed with TREADLE_ unless noted."""

    model_config = ConfigDict(frozen=True)

    home: Path = Field(
        default_factory=lambda: Path.cwd() / ".treadle",
        description="TREADLE_HOME: folder for local Kafka data, chDB data, Valkey data, logs and caches.",
    )
    kafka_bootstrap_servers: str = Field(
        default="127.0.0.1:19092",
        description="KAFKA_BOOTSTRAP_SERVERS: brokers to use; the local stack listens here by default.",
    )
    kafka_controller_port: int = Field(
        default=19093, description="TREADLE_KAFKA_CONTROLLER_PORT: KRaft controller port of the local broker."
    )
    kafka_version: str = Field(
        default="4.1.1", description="TREADLE_KAFKA_VERSION: Apache Kafka version the local stack runs."
    )
    kafka_brokers: int = Field(
        default=1,
        description="TREADLE_KAFKA_BROKERS: brokers of the local Kafka (`treadle up --brokers 3`): 3 is a KRaft "
        "cluster on KAFKA_BOOTSTRAP_SERVERS' port and the next two even ones, topics get 3 replicas (2 in sync); set "
        "it for every treadle command then.",
    )
    local_kafka: bool = Field(
        default=True,
        description="TREADLE_LOCAL_KAFKA: `treadle up` starts a broker on KAFKA_BOOTSTRAP_SERVERS; 0 uses yours.",
    )
    kafka_heap: str = Field(default="512m", description="TREADLE_KAFKA_HEAP: -Xmx of the local broker's JVM.")
    java_bin: str = Field(default="java", description="TREADLE_JAVA_BIN: Java 17+ used to run the local broker.")
    mvn_bin: str = Field(default="mvn", description="TREADLE_MVN_BIN: Maven, used once to download the broker's jars.")
    cache: Path | None = Field(
        default=None,
        description="TREADLE_CACHE: downloaded Kafka jars and Maven repository; unset means TREADLE_HOME/cache.",
    )
    clickhouse_url: str | None = Field(
        default=None,
        description="CLICKHOUSE_URL: e.g. http://user:pass@host:8123/db; unset means embedded chDB under TREADLE_HOME.",
    )
    redis_url: str | None = Field(
        default=None, description="REDIS_URL: unset means the bundled Valkey server on TREADLE_VALKEY_PORT."
    )
    valkey_port: int = Field(default=16379, description="TREADLE_VALKEY_PORT: port of the bundled Valkey server.")
    partitions: int = Field(
        default=4, description="TREADLE_PARTITIONS: partitions of every co-partitioned topic (input and output)."
    )
    replication_factor: int = Field(default=1, description="TREADLE_REPLICATION_FACTOR: replicas per topic.")
    topic_prefix: str = Field(
        default="treadle", description="TREADLE_TOPIC_PREFIX: prefix of every topic name (one deployment each)."
    )
    app_id: str = Field(default="treadle", description="TREADLE_APP_ID: Faust app id (consumer group, table names).")
    web_port: int = Field(
        default=16066,
        description="TREADLE_WEB_PORT: worker HTTP port: /metrics for Prometheus (the sink child's metrics included) "
        "and Faust's pages.",
    )
    bind_host: str = Field(
        default="127.0.0.1",
        description="TREADLE_BIND_HOST: address the worker's web port and the sink's SQL/metrics port bind; "
        "0.0.0.0 in containers so Prometheus can scrape. With embedded chDB the sink refuses a non-loopback address "
        "unless TREADLE_SQL_TOKEN is set (its SQL endpoint reads every table).",
    )
    gpu_sample_seconds: float = Field(
        default=10.0,
        description="TREADLE_GPU_SAMPLE_SECONDS: GPU telemetry period (NVML metrics and resource_samples events); "
        "0 turns it off.",
    )
    processors: tuple[str, ...] = Field(
        default=("steps",),
        description="TREADLE_PROCESSORS: comma-separated processors the worker runs, by plugin name "
        "(`treadle processors` lists them: steps, state, safety, credit, safety_judge, llm_judge).",
    )
    process_batch_size: int = Field(
        default=8000,
        description="TREADLE_PROCESS_BATCH_SIZE: input events the worker folds per batch, at most (a backlog fills "
        "it; live input makes smaller batches, see TREADLE_PROCESS_BATCH_SECONDS).",
    )
    commit_every: int = Field(
        default=50_000,
        ge=1,
        description="TREADLE_COMMIT_EVERY: input records acked between offset commits when the worker reads them "
        "faster than Faust's 2.8 s commit interval (a backlog). Each commit writes out the steps changed since the "
        "last one, so fewer commits write a step fewer times; a crash replays what was not committed.",
    )
    process_batch_seconds: float = Field(
        default=0.05,
        description="TREADLE_PROCESS_BATCH_SECONDS: longest wait to fill a batch while input trickles in (0: none).",
    )
    input_max_skew_s: float = Field(
        default=1.0,
        ge=0.0,
        description="TREADLE_INPUT_MAX_SKEW_S: how far (record timestamps) an input topic's partition may read ahead "
        "of a co-partitioned one with records left, e.g. catching up a backlog; inf = read them as fetched.",
    )
    catch_up_backlog: int = Field(
        default=2000,
        ge=0,
        description="TREADLE_CATCH_UP_BACKLOG: input records of a partition still in Kafka from which the worker is "
        "catching up there: it then publishes a step's rows once no required source is waiting, and its pending "
        "rows when it has caught up; 0 = always publish pending rows at once.",
    )
    output_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="zstd",
        description="TREADLE_OUTPUT_COMPRESSION: compression of the record batches a worker produces (outputs and "
        "table changelogs): none, gzip, snappy, lz4 or zstd (zstd needs Kafka clients 2.1+ to consume).",
    )
    reward_policy: Path | None = Field(
        default=None,
        description="TREADLE_REWARD_POLICY: JSON/YAML reward policy (specs per source); unset = every source "
        "optional, window 1 day. `treadle policy push` publishes newer versions at runtime.",
    )
    watermark_lag_s: float = Field(
        default=5.0,
        description="TREADLE_WATERMARK_LAG_S: bounded out-of-orderness; the watermark trails the newest event "
        "time by this.",
    )
    idle_timeout_s: float = Field(
        default=30.0,
        description="TREADLE_IDLE_TIMEOUT_S: a silent input partition stops holding the watermark back after this; "
        "when all are silent the watermark follows processing time. After such a silence each input topic holds it "
        "again, for at most this long, until it has delivered (docs/weaving-reference.md, W27).",
    )
    window_tick_s: float = Field(
        default=1.0, description="TREADLE_WINDOW_TICK_S: how often the worker closes due step windows with no input."
    )
    session_timeout_s: float = Field(
        default=10.0,
        ge=6.0,
        le=60.0,
        description="TREADLE_SESSION_TIMEOUT_S: how long the worker group waits for a silent worker before it hands "
        "its partitions to the others (heartbeats go every fifth of it, from the consumer's own thread): a crashed "
        "worker's partitions are processed again about this long plus a heartbeat after the crash. Lower fails over "
        "faster; but a worker cut off that long (a network blip, a paused VM, a broker's long GC) is taken for dead "
        "and its partitions move needlessly. Brokers refuse less than 6 s by default (group.min.session.timeout.ms).",
    )
    sink: Literal["child", "off"] = Field(
        default="child",
        description="TREADLE_SINK: child = `treadle worker` runs `treadle sink` as a child process; "
        "off = processors only (run `treadle sink` yourself).",
    )
    sql_port: int = Field(
        default=16067,
        description="TREADLE_SQL_PORT: port where the sink answers `treadle sql` and serves its own /metrics.",
    )
    sql_token: SecretStr | None = Field(
        default=None,
        description="TREADLE_SQL_TOKEN: shared secret of the sink's SQL endpoint: when set, every query must carry "
        "it (`treadle sql` sends it as a bearer token; /metrics stays open) and a wrong or missing one gets HTTP 401. "
        "Required to bind the endpoint to a non-loopback TREADLE_BIND_HOST; never logged.",
    )
    console_port: int = Field(
        default=16068,
        description="TREADLE_CONSOLE_PORT: port of `treadle console`, the read-only web console (binds 127.0.0.1 "
        "unless told otherwise).",
    )
    console_token: SecretStr | None = Field(
        default=None,
        description="TREADLE_CONSOLE_TOKEN: secret every console request must carry (`Authorization: Bearer`, or "
        "`?token=` once, which sets a cookie); required to bind `treadle console` to a non-loopback address.",
    )
    otlp_port: int = Field(
        default=4318,
        description="TREADLE_OTLP_PORT: port of `treadle otlp`, the OTLP/HTTP receiver (POST /v1/traces; 4318 is "
        "OTLP/HTTP's usual port).",
    )
    otlp_conventions: Literal["genai", "openinference"] = Field(
        default="genai",
        description="TREADLE_OTLP_CONVENTIONS: attribute names `treadle otlp` reads: genai = OpenTelemetry's GenAI "
        "semantic conventions (gen_ai.*), openinference = OpenInference's (Phoenix: openinference.span.kind, ...).",
    )
    otlp_session_attribute: str = Field(
        default="",
        description="TREADLE_OTLP_SESSION_ATTRIBUTE: span or resource attribute holding the session id; empty = the "
        "conventions' own (gen_ai.conversation.id, or session.id); a trace without one is a session of its own.",
    )
    otlp_max_request_bytes: int = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="TREADLE_OTLP_MAX_REQUEST_BYTES: largest OTLP request body, compressed or not (HTTP 413 above).",
    )
    otlp_max_pending: int = Field(
        default=20_000,
        gt=0,
        description="TREADLE_OTLP_MAX_PENDING: events the receiver may have waiting for the broker's "
        "acknowledgement; above it requests get HTTP 429 with Retry-After instead of being accepted.",
    )
    otlp_ack_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="TREADLE_OTLP_ACK_TIMEOUT_S: how long a request waits for the broker to acknowledge its events; "
        "past it the answer is HTTP 503 with Retry-After (the exporter resends; the copies are duplicates).",
    )
    otlp_retry_after_s: int = Field(
        default=5,
        gt=0,
        description="TREADLE_OTLP_RETRY_AFTER_S: the Retry-After (seconds) of the receiver's 429 and 503 answers.",
    )
    sink_batch_size: int = Field(
        default=5000,
        description="TREADLE_SINK_BATCH_SIZE: rows per ClickHouse insert: a table's batch is inserted as soon as it "
        "holds this many (the sink fetches 64 KiB or 100 ms of records at a time).",
    )
    sink_flush_seconds: float = Field(
        default=0.5, description="TREADLE_SINK_FLUSH_SECONDS: longest wait before a partial batch is inserted."
    )
    sink_native_blocks: bool = Field(
        default=True,
        description="TREADLE_SINK_NATIVE_BLOCKS: the sink turns the Transitions, woven and late rewards it keeps as "
        "Avro bytes into ClickHouse Native blocks with treadle_native (~2x the rows per CPU-second of the Avro "
        "container ClickHouse decodes itself); a batch it refuses goes the Python way. 0: the Avro container.",
    )
    credit_rule: Literal["terminal", "uniform", "discounted"] = Field(
        default="discounted",
        description="TREADLE_CREDIT_RULE: how the credit processor spreads an episode reward over its steps "
        "(terminal, uniform or discounted); a reward's credit_rule attribute overrides it.",
    )
    credit_gamma: float = Field(
        default=0.99,
        ge=0.0,
        le=1.0,
        description="TREADLE_CREDIT_GAMMA: discount of the discounted credit rule (step t of T gets "
        "gamma**(T-1-t) * R), in [0, 1]; a reward's gamma attribute overrides it.",
    )
    safety_judge_values: str = Field(
        default="-1,0,1",
        description="TREADLE_SAFETY_JUDGE_VALUES: the safety_judge's reward when an event is unsafe (high severity, "
        "or PII in a tool result), cautionary (only low/medium rules fired) and clean, comma-separated.",
    )
    llm_judge_url: str | None = Field(
        default=None,
        description="TREADLE_LLM_JUDGE_URL: HTTP endpoint the llm_judge posts each step to; required when "
        "llm_judge is in TREADLE_PROCESSORS.",
    )
    llm_judge_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="TREADLE_LLM_JUDGE_TIMEOUT_S: timeout of one llm_judge HTTP call (3 attempts per step).",
    )
    llm_judge_concurrency: int = Field(
        default=8, ge=1, description="TREADLE_LLM_JUDGE_CONCURRENCY: llm_judge HTTP calls in flight at once."
    )
    worker_fetch_min_bytes: int = Field(
        default=16_384,
        ge=1,
        description="TREADLE_WORKER_FETCH_MIN_BYTES: a worker's input fetch returns once this many bytes are there "
        "(or after 100 ms). 16 KiB spares the broker a request per few records under a steady trickle; 1 gives sparse "
        "input its lowest latency (with TREADLE_PROCESS_BATCH_SECONDS=0, a plans deployment's releases: see "
        "benchmarks.md, release latency).",
    )
    plan_aging_s: float = Field(
        default=60.0,
        ge=0,
        description="TREADLE_PLAN_AGING_S: event-time seconds a ready subgoal waits before the plans scheduler stops "
        "letting smaller, later subgoals of its class pass it (and reserves an executor for it): no starvation.",
    )
    plan_finished_retention_s: float = Field(
        default=3600.0,
        ge=0,
        description="TREADLE_PLAN_FINISHED_RETENTION_S: event-time seconds the plans scheduler remembers a finished "
        "plan (a digest of it: a resubmission within this changes nothing, a different plan under its id is refused).",
    )
    plan_finished_limit: int = Field(
        default=100_000,
        ge=1,
        description="TREADLE_PLAN_FINISHED_LIMIT: finished plans the plans scheduler remembers at most (oldest "
        "forgotten first).",
    )
    plan_executor_forget_s: float = Field(
        default=600.0,
        ge=0,
        description="TREADLE_PLAN_EXECUTOR_FORGET_S: event-time seconds after an executor's advertisement ran out "
        "that the plans scheduler forgets it and the room its timed-out attempts held.",
    )
    diagnosis_failure_threshold: int = Field(
        default=3,
        ge=2,
        description="TREADLE_DIAGNOSIS_FAILURE_THRESHOLD: plan_diagnosis flags a tool and params as repeatedly "
        "failing (a repeated_failure metric and a SchedulerAdvice) at this many failures within the window.",
    )
    diagnosis_failure_window_s: float = Field(
        default=300.0,
        gt=0,
        description="TREADLE_DIAGNOSIS_FAILURE_WINDOW_S: plan_diagnosis's event-time window for repeated failures; "
        "its advice to skip retries holds this long after the failure that triggered it.",
    )
    diagnosis_variance_min_samples: int = Field(
        default=5,
        ge=2,
        description="TREADLE_DIAGNOSIS_VARIANCE_MIN_SAMPLES: rewards of one tool and params (per source and name) "
        "before plan_diagnosis reports their variance.",
    )
    diagnosis_variance_alert: float = Field(
        default=0.25,
        ge=0,
        description="TREADLE_DIAGNOSIS_VARIANCE_ALERT: a reward_variance at or above this is severity high (else low).",
    )
    diagnosis_step_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="TREADLE_DIAGNOSIS_STEP_TIMEOUT_S: event-time seconds a dispatched step may wait for its tool "
        "result (unless the dispatch has its own deadline) before plan_diagnosis reports a stall.",
    )
    state_auto_nodes: bool = Field(
        default=True,
        description="TREADLE_STATE_AUTO_NODES: dispatches and tool results add state-graph nodes and a causes edge.",
    )
    state_idle_flush_s: float = Field(
        default=1.0,
        description="TREADLE_STATE_IDLE_FLUSH_S: longest wait of a state event for its session's other topics "
        "to catch up before it is applied anyway.",
    )
    state_idle_flush_max_s: float = Field(
        default=30.0,
        ge=0.0,
        description="TREADLE_STATE_IDLE_FLUSH_MAX_S: longest wait of a state event while this worker has not yet "
        "folded what its session's input partitions held when the wait began (a lagging worker): it waits past "
        "TREADLE_STATE_IDLE_FLUSH_S then, so the versions of a backlog follow seq order however far behind the "
        "worker is.",
    )
    state_max_buffer: int = Field(
        default=1_000, description="TREADLE_STATE_MAX_BUFFER: most events a session's state reorder buffer holds."
    )
    state_max_nodes: int = Field(
        default=1_000_000,
        description="TREADLE_STATE_MAX_NODES: most live nodes per session; a delta that adds more goes to dead "
        "letters.",
    )
    state_history: int = Field(
        default=256, description="TREADLE_STATE_HISTORY: versions per session that rollback_to can reach."
    )
    state_ended_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="TREADLE_STATE_ENDED_TTL_S: how long a closed session's latest state stays in Redis.",
    )
    step_retention_s: float = Field(
        default=3600.0,
        ge=0,
        description="TREADLE_STEP_RETENTION_S: a step's state is deleted this long (event time, by the watermark) "
        "after its last reward deadline; a reward arriving later for it is reported as an orphan.",
    )
    table_memory_mb: int = Field(
        default=64,
        ge=4,
        description="TREADLE_TABLE_MEMORY_MB: RocksDB memory of the worker, all tables and partitions together: one "
        "shared block cache that the memtables (up to half of it) are charged to; Faust's own default is about "
        "2.2 GB per table partition.",
    )
    gc_thresholds: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt] = Field(
        default=(100_000, 10, 20),
        description="TREADLE_GC_THRESHOLDS: gc.set_threshold of the worker and sink processes, comma-separated; "
        "the first is above what one input batch allocates, so its short-lived objects die before a young "
        "collection walks them, and full collections, which walk every parsed step and free next to nothing, "
        "come ~300x less often than with CPython's default (700,10,10).",
    )
    max_event_bytes: int = Field(
        default=900_000,
        ge=1024,
        description="TREADLE_MAX_EVENT_BYTES: largest encoded event (Avro value) treadle takes: the SDK raises "
        "EventTooLargeError before sending a larger one, the worker dead-letters one (stage VALIDATE), and derived "
        "records larger than this are truncated with the truncation recorded. Also the largest value one key may hold "
        "in a processor's table (a step, an episode's credit state, a judged step, a state version or TTL index): the "
        "event that would pass it is a PROCESS dead letter (docs/operations.md, Size limits). ~148 KB below Kafka's "
        "1 MiB record limit, so a dead letter wrapping a full-size event, or a step holding it with its other events, "
        "still fits.",
    )
    spool_dir: Path | None = Field(
        default=None,
        description="TREADLE_SPOOL_DIR: where the SDK keeps events while the brokers are unreachable (one "
        "subdirectory per stream, `<agent_id>-<n>`), and resends them from, in order, when they return or when the "
        "next stream of the same agent_id starts after a restart. Unset: no spool; events not acknowledged within "
        "the stream's delivery_timeout_s are reported failed (ProducerError).",
    )
    spool_max_bytes: int = Field(
        default=1024**3,
        ge=1024 * 1024,
        description="TREADLE_SPOOL_MAX_BYTES: most bytes one stream's spool holds (1 GiB); past it, see "
        "TREADLE_SPOOL_WHEN_FULL.",
    )
    spool_after_s: float = Field(
        default=5.0,
        gt=0,
        description="TREADLE_SPOOL_AFTER_S: with a spool, how long an event may stay unacknowledged before the "
        "stream takes the brokers for unreachable and spools its unacknowledged and following events.",
    )
    spool_when_full: Literal["raise", "block"] = Field(
        default="raise",
        description="TREADLE_SPOOL_WHEN_FULL: a full spool makes the SDK call raise SpoolFullError (nothing sent, "
        "nothing counted: the agent decides), or `block` until the spool has room again.",
    )
    tool_schemas: Path | None = Field(
        default=None,
        description="TREADLE_TOOL_SCHEMAS: JSON file {tool: JSON Schema} checked at the processor boundary.",
    )

    @property
    def embedded_clickhouse(self) -> bool:
        return self.clickhouse_url is None

    @property
    def chdb_path(self) -> Path:
        return self.home / "chdb"

    @property
    def worker_dir(self) -> Path:
        return self.home / "worker"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def cache_dir(self) -> Path:
        return self.cache if self.cache is not None else self.home / "cache"

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings in another process."""
        env = {}
        for field, value in self.model_dump().items():
            if isinstance(value, tuple):
                value = ",".join(map(str, value))
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if value is not None:
                env[env_var(field)] = str(int(value) if isinstance(value, bool) else value)
        return env

    @field_validator("kafka_brokers")
    @classmethod
    def _one_or_three(cls, value: int) -> int:
        if value not in (1, 3):
            raise ValueError("1 (one broker) or 3 (a KRaft cluster of three)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _local_cluster(cls, values: Any) -> Any:
        """With a local 3-broker cluster: its three addresses to bootstrap from (any one may be down) and 3 replicas
        per topic, unless KAFKA_BOOTSTRAP_SERVERS / TREADLE_REPLICATION_FACTOR say otherwise."""
        if not isinstance(values, dict) or str(values.get("kafka_brokers", 1)).strip() != "3":
            return values  # one broker, or a count the field's own check refuses
        if str(values.get("local_kafka", True)).lower() in ("0", "false"):
            return values
        brokers = int(values["kafka_brokers"])
        values = dict(values)
        servers = str(values.get("kafka_bootstrap_servers", cls.model_fields["kafka_bootstrap_servers"].default))
        host, _, port = servers.strip().rpartition(":")
        if "," not in servers and port.isdigit():
            values["kafka_bootstrap_servers"] = ",".join(f"{host}:{int(port) + 2 * i}" for i in range(brokers))
        values.setdefault("replication_factor", min(3, brokers))
        return values

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for field in cls.model_fields:
            var = env_var(field)
            if env.get(var):
                values[field] = tuple(env[var].split(",")) if field in _LIST_FIELDS else env[var]
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise InvalidSettingError(_explain(exc, env)) from None


def _explain(exc: ValidationError, env: dict[str, str]) -> str:
    """The first problem of a ValidationError as `VAR='value': why` (item N of a comma-separated list)."""
    problems = exc.errors()
    first = problems[0]
    field, *inner = first["loc"]
    var = env_var(str(field))
    items = "".join(f" (item {i + 1})" for i in inner if isinstance(i, int))
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{var}={env.get(var, '')!r}{items}: {first['msg']}{more}"
