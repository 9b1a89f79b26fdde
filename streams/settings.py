"""Configuration from the environment, with documented defaults.

Every knob lives here so the README table and the code cannot drift apart: each field's
description is the documentation, and `Settings.from_env()` is the only reader of os.environ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

REPO_ROOT = Path(__file__).resolve().parents[1]
_ENV_NAMES = {
    "kafka_bootstrap_servers": "KAFKA_BOOTSTRAP_SERVERS",
    "clickhouse_url": "CLICKHOUSE_URL",
    "redis_url": "REDIS_URL",
}


class Settings(BaseModel):
    """treadle settings; the env var is the upper-cased field name prefixed with TREADLE_ unless noted."""

    model_config = ConfigDict(frozen=True)

    home: Path = Field(
        default=REPO_ROOT / ".treadle",
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
        default=16066, description="TREADLE_WEB_PORT: worker HTTP port (/sql for `treadle sql`, Faust pages)."
    )
    processors: tuple[str, ...] = Field(
        default=("steps",),
        description="TREADLE_PROCESSORS: comma-separated built-in processors the worker runs (steps).",
    )
    process_batch_size: int = Field(
        default=1000, description="TREADLE_PROCESS_BATCH_SIZE: input events the worker folds per batch."
    )
    process_batch_seconds: float = Field(
        default=0.05, description="TREADLE_PROCESS_BATCH_SECONDS: longest wait to fill a batch before folding it."
    )
    sink: Literal["child", "off"] = Field(
        default="child",
        description="TREADLE_SINK: child = `treadle worker` runs `treadle sink` as a child process; "
        "off = processors only (run `treadle sink` yourself).",
    )
    sql_port: int = Field(
        default=16067, description="TREADLE_SQL_PORT: 127.0.0.1 port where the sink answers `treadle sql`."
    )
    sink_batch_size: int = Field(default=5000, description="TREADLE_SINK_BATCH_SIZE: rows per ClickHouse insert.")
    sink_flush_seconds: float = Field(
        default=0.5, description="TREADLE_SINK_FLUSH_SECONDS: longest wait before a partial batch is inserted."
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
                value = ",".join(value)
            if value is not None:
                env[_ENV_NAMES.get(field, f"TREADLE_{field.upper()}")] = str(
                    int(value) if isinstance(value, bool) else value
                )
        return env

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for field in cls.model_fields:
            var = _ENV_NAMES.get(field, f"TREADLE_{field.upper()}")
            if env.get(var):
                values[field] = tuple(env[var].split(",")) if field == "processors" else env[var]
        values.update(overrides)
        return cls(**values)
