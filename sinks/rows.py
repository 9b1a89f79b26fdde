"""Decoded Avro records → ClickHouse rows, one pure function per topic kind.

Deterministic on purpose: the same record always yields the same row (no wall-clock columns, sorted JSON keys),
so replaying a topic after a crash re-inserts identical rows that ReplacingMergeTree collapses. Records arrive
as the codec decodes them, with logical types stripped: timestamps are int microseconds, uuids str, enums str.
Rows are dicts keyed by the column names of TABLE_COLUMNS, in a form clickhouse-connect inserts directly
(DateTime64(6) columns take int microseconds; Nested columns are one list per sub-column).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from topics.names import (
    DISPATCH,
    EXECUTOR_HEARTBEAT,
    LIFECYCLE,
    PLAN_FINISHED,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    REWARD,
    SCHEDULER_ADVICE,
    STATE_DELTA,
    SUBGOAL_ESCALATED,
    SUBGOAL_RELEASED,
    SUBGOAL_REROUTED,
    SUBGOAL_RETRIED,
    SUBGOAL_STATUS,
    SUBGOAL_TIMED_OUT,
    TOOL_RESULT,
)

# Revision of the row format below; bump it when a mapper changes what it writes, so that rows written by the
# new mapper replace old ones on replay (it is the version column of raw_events and reward_components).
ROW_FORMAT_REVISION = 1

INPUT_SCHEMAS: Mapping[str, str] = {
    "actions": DISPATCH,
    "tool_results": TOOL_RESULT,
    "rewards": REWARD,
    "state_deltas": STATE_DELTA,
    "lifecycle": LIFECYCLE,
}

_COMPONENT_FIELDS = (
    "event_id", "source", "name", "value", "confidence", "weight", "annotator", "event_time",
    "contribution", "adjusted_value", "lateness_ms", "evidence", "imputed",
)  # fmt: skip
_COMPONENT_COLUMNS = {
    prefix: tuple(f"{prefix}.{f}" for f in _COMPONENT_FIELDS) for prefix in ("reward_components", "components")
}
_CONFLICT_FIELDS = ("a_event_id", "b_event_id", "a_value", "b_value", "difference")

TABLE_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "raw_events": (
        "kind", "schema_name", "event_id", "session_id", "agent_id", "episode_id", "logical_event_id", "seq",
        "event_time", "policy_version", "trace_id", "attributes", "payload_json", "ingested_revision",
    ),
    "transitions": (
        "session_id", "step", "logical_event_id", "revision", "agent_id", "episode_id", "trace_id", "policy_version",
        "tool", "params_json", "dispatched_at", "tool_status", "output", "error", "latency_ms", "cost_usd",
        "tokens_in", "tokens_out", "result_at", "reward", "reward_status", "reward_revision",
        *(f"reward_components.{f}" for f in _COMPONENT_FIELDS), "updated_at", "truncated_bytes",
    ),
    "reward_components": (
        "logical_event_id", "session_id", "event_id", "agent_id", "episode_id", "source", "name", "value",
        "confidence", "annotator", "evidence", "event_time", "policy_version", "trace_id", "ingested_revision",
    ),
    "woven_rewards": (
        "logical_event_id", "session_id", "episode_id", "step", "revision", "value", "status", "fusion",
        "policy_version", *(f"components.{f}" for f in _COMPONENT_FIELDS), "woven_at", "reward_policy_version",
        "rules_fired", *(f"conflicts.{f}" for f in _CONFLICT_FIELDS), "imputed",
    ),
    "dead_letters": (
        "dead_letter_id", "stage", "reason", "topic", "partition", "offset", "key", "value", "event_id",
        "session_id", "schema_name", "failed_at", "value_truncated_bytes",
    ),
    "rejected_rows": (
        "rejected_id", "stage", "target_table", "reason", "topic", "partition", "offset", "value", "rejected_at",
    ),
    "late_rewards": (
        "event_id", "logical_event_id", "session_id", "episode_id", "agent_id", "policy_version", "source", "name",
        "value", "confidence", "annotator", "reason", "detail", "lateness_ms", "deadline", "event_time",
        "reward_policy_version", "revision",
    ),
    "resource_samples": (
        "sample_id", "host", "gpu_index", "gpu_uuid", "gpu_name", "utilization", "memory_used_bytes",
        "memory_total_bytes", "power_watts", "sampled_at",
    ),
    "evaluation_metrics": (
        "metric_id", "evaluator", "metric", "rule", "value", "severity", "session_id", "episode_id",
        "logical_event_id", "agent_id", "policy_version", "source_event_id", "event_time", "evidence",
    ),
    "state_versions": (
        "session_id", "ordinal", "version_id", "parent_id", "kind", "event_id", "seq", "logical_event_id",
        "episode_id", "tool", "step", "event_time", "rollback_to", "late", "node_count", "edge_count",
        "node_changes", "edge_changes",
    ),
    "state_nodes": (
        "session_id", "from_ordinal", "node_id", "type", "data_json", "valid_from", "expires_at", "caused_by_tool",
        "open_op",
    ),
    "state_node_causes": ("caused_by_tool", "valid_from", "session_id", "node_id", "type", "from_ordinal"),
    "state_node_ends": ("session_id", "to_ordinal", "node_id", "from_ordinal", "valid_to", "close_op"),
    "state_edges": ("session_id", "from_ordinal", "src", "dst", "type", "data_json", "valid_from", "open_op"),
    "state_edge_ends": ("session_id", "to_ordinal", "src", "dst", "type", "from_ordinal", "valid_to", "close_op"),
    "contract_checks": (
        "check_id", "session_id", "episode_id", "logical_event_id", "step", "tool", "contract", "contract_version",
        "phase", "outcome", "clause", "failed_clauses", "reason", "values_json", "state_version_id", "source_event_id",
        "event_time",
    ),
    "step_evidence": (
        "event_id", "session_id", "episode_id", "logical_event_id", "schema_name", "tool", "sha256", "size_bytes",
        "attributes", "event_time",
    ),
    "llm_calls": (
        "event_id", "session_id", "logical_event_id", "agent_id", "episode_id", "seq", "event_time", "policy_version",
        "trace_id", "attributes", "provider", "model", "request_id", "response_id", "choice_index", "messages_json",
        "prompt_text", "completion_text", "tool_calls_json", "prompt_token_ids", "completion_token_ids",
        "completion_logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_ms",
        "cost_usd", "temperature", "top_p", "seed", "max_tokens", "params_json", "ingested_revision",
    ),
    # Plans (docs/plans.md): the plan_events and plan_decisions topics, routed by record schema (PLAN_ROWS).
    "plans": (
        "session_id", "plan_id", "episode_id", "agent_id", "goal", "event_id", "subgoal_count", "submitted_at",
        "keep_first",
    ),
    "plan_subgoals": (
        "session_id", "plan_id", "subgoal_id", "position", "event_id", "tool", "agent", "params_json",
        "resource_class", "gpu_memory_mb", "gpus", "cpu", "deadline_s", "max_attempts", "backoff_s",
        "backoff_multiplier", "has_fallback", "fallback_tool", "fallback_agent", "fallback_params_json",
        "fallback_resource_class", "fallback_gpu_memory_mb", "fallback_gpus", "fallback_cpu", "depends_on",
        "submitted_at", "keep_first",
    ),
    "subgoal_statuses": (
        "session_id", "plan_id", "subgoal_id", "attempt", "state", "executor_id", "output_ref", "error_class", "error",
        "event_id", "event_time",
    ),
    "executor_heartbeats": (
        "executor_id", "resource_class", "free_gpu_memory_mb", "free_gpus", "free_cpu", "running", "valid_for_s",
        "host", "sent_at",
    ),
    "plan_decisions": (
        "decision_id", "kind", "session_id", "episode_id", "plan_id", "subgoal_id", "attempt", "next_attempt",
        "resource_class", "work_topic", "executor_id", "tool", "agent", "params_json", "gpu_memory_mb", "gpus", "cpu",
        "deadline_s", "fallback", "error_class", "retry_at", "last_seen_at", "cancelled", "outcome", "succeeded",
        "escalated", "decided_at",
    ),
    # Self-diagnosis advice on plan_events (migration 0020).
    "scheduler_advice": (
        "advice_id", "action", "tool", "params_hash", "failures", "window_s", "reason", "evaluator", "source_event_id",
        "advised_at", "valid_until",
    ),
}  # fmt: skip

# Topic kinds whose records are their table's row field by field (same names; nested records as Nested columns;
# timestamp-micros as DateTime64(6)), so ClickHouse can read their Avro itself (sinks/avro_container.py) and the
# sink never decodes them. tests/test_sink_avro.py holds each to the row its Python mapper below makes.
AVRO_TABLES: Mapping[str, str] = {
    "transitions": "transitions",
    "woven_rewards": "woven_rewards",
    "late_rewards": "late_rewards",
}

Row = dict[str, Any]


def rows_for(kind: str, record: Mapping[str, Any], schema_name: str | None = None) -> list[tuple[str, Row]]:
    """[(table, row)] for one decoded record of topic kind `kind`; a reward lands in two tables.

    A topic that carries several schemas (plan_events, plan_decisions) is mapped by the record's `schema_name`."""
    mapper = _MAPPERS.get(kind)
    if mapper is None:
        mapper = PLAN_ROWS.get(schema_name) if schema_name is not None else None
        if mapper is None:
            raise ValueError(f"no ClickHouse table takes records of topic kind {kind!r}, schema {schema_name!r} "
                             f"(known kinds: {', '.join(_MAPPERS)}; schemas: {', '.join(PLAN_ROWS)})")  # fmt: skip
    return mapper(kind, record)


def micros(value: int | datetime) -> int:
    """UTC microseconds since the epoch; accepts a datetime too, in case a decoder keeps logical types."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        delta = value - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return int(value)


def _optional_micros(value: int | datetime | None) -> int | None:
    return None if value is None else micros(value)


def _json(value: Any) -> str:
    """Canonical JSON (sorted keys), so equal payloads give byte-equal rows; bytes become hex."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=_json_default).decode()


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return bytes(value).hex()
    if isinstance(value, datetime):
        return micros(value)
    raise TypeError(f"cannot store {type(value).__name__} in payload_json")


def _raw_event(kind: str, record: Mapping[str, Any]) -> Row:
    envelope = record["envelope"]
    return {
        "kind": kind,
        "schema_name": INPUT_SCHEMAS[kind],
        "event_id": str(envelope["event_id"]),
        "session_id": envelope["session_id"],
        "agent_id": envelope["agent_id"],
        "episode_id": envelope["episode_id"],
        "logical_event_id": envelope["logical_event_id"],
        "seq": envelope["seq"],
        "event_time": micros(envelope["event_time"]),
        "policy_version": envelope.get("policy_version", ""),
        "trace_id": envelope.get("trace_id", ""),
        "attributes": dict(envelope.get("attributes") or {}),
        "payload_json": _json({k: v for k, v in record.items() if k != "envelope"}),
        "ingested_revision": ROW_FORMAT_REVISION,
    }


def _input_event(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return [("raw_events", _raw_event(kind, record))]


def _reward_signal(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    envelope = record["envelope"]
    component = {
        "logical_event_id": envelope["logical_event_id"],
        "session_id": envelope["session_id"],
        "event_id": str(envelope["event_id"]),
        "agent_id": envelope["agent_id"],
        "episode_id": envelope["episode_id"],
        "source": record["source"],
        "name": record.get("name", "reward"),
        "value": float(record["value"]),
        "confidence": float(record.get("confidence", 1.0)),
        "annotator": str(record.get("annotator", "CODE")),
        "evidence": record.get("evidence"),
        "event_time": micros(envelope["event_time"]),
        "policy_version": envelope.get("policy_version", ""),
        "trace_id": envelope.get("trace_id", ""),
        "ingested_revision": ROW_FORMAT_REVISION,
    }
    return [("raw_events", _raw_event(kind, record)), ("reward_components", component)]


def _components(prefix: str, components: Sequence[Mapping[str, Any]]) -> Row:
    """A RewardComponent list as Nested sub-columns: one list per field, aligned by index.

    Explanation fields absent from older records take the schema's defaults (adjusted_value None: same as value).
    One tuple per component, transposed by zip: a comprehension per field cost a frame each, 13 per record.
    """
    values = [
        (
            str(c["event_id"]), c["source"], c["name"], float(c["value"]), float(c["confidence"]),
            float(c.get("weight", 1.0)), str(c["annotator"]), micros(c["event_time"]),
            float(c.get("contribution", 0.0)), _optional_float(c.get("adjusted_value")), int(c.get("lateness_ms", 0)),
            c.get("evidence"), bool(c.get("imputed", False)),
        )
        for c in components
    ]  # fmt: skip
    columns = zip(*values, strict=True) if values else ((),) * len(_COMPONENT_FIELDS)
    return dict(zip(_COMPONENT_COLUMNS[prefix], map(list, columns), strict=True))


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _conflicts(conflicts: Sequence[Mapping[str, Any]]) -> Row:
    """RewardConflict records as the conflicts.* Nested sub-columns."""
    return {
        "conflicts.a_event_id": [str(c["a_event_id"]) for c in conflicts],
        "conflicts.b_event_id": [str(c["b_event_id"]) for c in conflicts],
        "conflicts.a_value": [float(c["a_value"]) for c in conflicts],
        "conflicts.b_value": [float(c["b_value"]) for c in conflicts],
        "conflicts.difference": [float(c["difference"]) for c in conflicts],
    }


def _transition(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    latency = record.get("latency_ms")
    reward = record.get("reward")
    row = {
        "session_id": record["session_id"],
        "step": record["step"],
        "logical_event_id": record["logical_event_id"],
        "revision": record["revision"],
        "agent_id": record["agent_id"],
        "episode_id": record["episode_id"],
        "trace_id": record.get("trace_id", ""),
        "policy_version": record.get("policy_version", ""),
        "tool": record["tool"],
        "params_json": record["params_json"],
        "dispatched_at": micros(record["dispatched_at"]),
        "tool_status": record.get("tool_status"),
        "output": record.get("output"),
        "error": record.get("error"),
        "latency_ms": None if latency is None else float(latency),
        "cost_usd": float(record.get("cost_usd", 0.0)),
        "tokens_in": record.get("tokens_in", 0),
        "tokens_out": record.get("tokens_out", 0),
        "result_at": _optional_micros(record.get("result_at")),
        "reward": None if reward is None else float(reward),
        "reward_status": record.get("reward_status", "pending"),
        "reward_revision": record.get("reward_revision", 0),
        **_components("reward_components", record.get("reward_components") or []),
        "updated_at": micros(record["updated_at"]),
        "truncated_bytes": record.get("truncated_bytes", 0),
    }
    return [("transitions", row)]


def _woven_reward(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {
        "logical_event_id": record["logical_event_id"],
        "session_id": record["session_id"],
        "episode_id": record["episode_id"],
        "step": record["step"],
        "revision": record["revision"],
        "value": float(record["value"]),
        "status": record["status"],
        "fusion": record["fusion"],
        "policy_version": record.get("policy_version", ""),
        **_components("components", record["components"]),
        "woven_at": micros(record["woven_at"]),
        "reward_policy_version": record.get("reward_policy_version", ""),
        "rules_fired": list(record.get("rules_fired") or []),
        **_conflicts(record.get("conflicts") or []),
        "imputed": list(record.get("imputed") or []),
    }
    return [("woven_rewards", row)]


_LLM_CALL_FIELDS = TABLE_COLUMNS["llm_calls"][10:-1]  # the record's own fields, named as its columns


def _llm_call(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    """An LlmCall: its own table only (not raw_events, where its token arrays would be stored twice)."""
    envelope = record["envelope"]
    row: Row = {
        "event_id": str(envelope["event_id"]),
        "session_id": envelope["session_id"],
        "logical_event_id": envelope["logical_event_id"],
        "agent_id": envelope["agent_id"],
        "episode_id": envelope["episode_id"],
        "seq": envelope["seq"],
        "event_time": micros(envelope["event_time"]),
        "policy_version": envelope.get("policy_version", ""),
        "trace_id": envelope.get("trace_id", ""),
        "attributes": dict(envelope.get("attributes") or {}),
    }
    for name in _LLM_CALL_FIELDS:
        row[name] = record[name]
    row["completion_logprobs"] = [float(v) for v in record["completion_logprobs"]]
    row["ingested_revision"] = ROW_FORMAT_REVISION
    return [("llm_calls", row)]


def _dead_letter(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {
        "dead_letter_id": record["dead_letter_id"],
        "stage": str(record["stage"]),
        "reason": record["reason"],
        "topic": record["topic"],
        "partition": record["partition"],
        "offset": record["offset"],
        "key": record.get("key"),
        "value": record.get("value"),
        "event_id": record.get("event_id"),
        "session_id": record.get("session_id"),
        "schema_name": record.get("schema_name"),
        "failed_at": micros(record["failed_at"]),
        "value_truncated_bytes": record.get("value_truncated_bytes", 0),
    }
    return [("dead_letters", row)]


def _evaluation_metric(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {
        "metric_id": record["metric_id"],
        "evaluator": record["evaluator"],
        "metric": record["metric"],
        "rule": record["rule"],
        "value": float(record["value"]),
        "severity": record["severity"],
        "session_id": record["session_id"],
        "episode_id": record["episode_id"],
        "logical_event_id": record["logical_event_id"],
        "agent_id": record["agent_id"],
        "policy_version": record.get("policy_version", ""),
        "source_event_id": record["source_event_id"],
        "event_time": micros(record["event_time"]),
        "evidence": record.get("evidence"),
    }
    return [("evaluation_metrics", row)]


def _late_reward(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["late_rewards"]}
    row["deadline"], row["event_time"] = micros(record["deadline"]), micros(record["event_time"])
    return [("late_rewards", row)]


def _resource_sample(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["resource_samples"]}
    row["sampled_at"] = micros(record["sampled_at"])
    return [("resource_samples", row)]


def _state_version(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    """A StateVersion: its row, an end row per interval it closed and an open row per interval it began."""
    at = micros(record["event_time"])
    version = {name: record[name] for name in TABLE_COLUMNS["state_versions"][:10]}
    version.update(
        tool=record.get("tool") or "", step=record.get("step"), event_time=at, rollback_to=record.get("rollback_to"),
        late=int(bool(record.get("late"))), node_count=record["node_count"], edge_count=record["edge_count"],
        node_changes=len(record["node_changes"]), edge_changes=len(record["edge_changes"]),
    )  # fmt: skip
    rows: list[tuple[str, Row]] = [("state_versions", version)]
    for change in record["node_changes"]:
        key = {"session_id": record["session_id"], "node_id": change["node_id"]}
        rows += _interval_rows("state_node", key, change, record["ordinal"], at)
    for change in record["edge_changes"]:
        key = {"session_id": record["session_id"], "src": change["src"], "dst": change["dst"], "type": change["type"]}
        rows += _interval_rows("state_edge", key, change, record["ordinal"], at)
    return rows


def _interval_rows(table: str, key: Row, change: Mapping[str, Any], ordinal: int, at: int) -> list[tuple[str, Row]]:
    """The end row of the interval a change closed and the open row of the one it began."""
    rows: list[tuple[str, Row]] = []
    before, after, op = change["prev"], change["next"], change["op"]
    if before is not None:
        expires = _optional_micros(before.get("expires_at"))
        end = min(at, expires) if expires is not None else at  # a TTL'd node ended at its expiry
        rows.append((f"{table}_ends", {**key, "to_ordinal": ordinal, "from_ordinal": before["from_ordinal"],
                                        "valid_to": end, "close_op": op}))  # fmt: skip
    if after is not None:
        opened = {
            **key,
            "from_ordinal": after["from_ordinal"],
            "data_json": after["data_json"],
            "valid_from": micros(after["valid_from"]),
            "open_op": "restore" if op == "restore" else "upsert",
        }
        if table == "state_node":
            opened.update(type=after["type"], expires_at=_optional_micros(after.get("expires_at")),
                          caused_by_tool=after.get("caused_by_tool", ""))  # fmt: skip
        rows.append((f"{table}s", opened))
        if opened.get("caused_by_tool"):  # the narrow copy that "caused by tool X lately" reads
            cause = ("caused_by_tool", "valid_from", "session_id", "node_id", "type", "from_ordinal")
            rows.append(("state_node_causes", {name: opened[name] for name in cause}))
    return rows


def _contract_check(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["contract_checks"]}
    row["event_time"] = micros(record["event_time"])
    return [("contract_checks", row)]


def _step_evidence(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["step_evidence"]}
    row["event_time"] = micros(record["event_time"])
    return [("step_evidence", row)]


_MAPPERS: Mapping[str, Callable[[str, Mapping[str, Any]], list[tuple[str, Row]]]] = {
    "actions": _input_event,
    "tool_results": _input_event,
    "rewards": _reward_signal,
    "state_deltas": _input_event,
    "lifecycle": _input_event,
    "llm_calls": _llm_call,
    "transitions": _transition,
    "woven_rewards": _woven_reward,
    "dead_letters": _dead_letter,
    "evaluation_metrics": _evaluation_metric,
    "resource_samples": _resource_sample,
    "late_rewards": _late_reward,
    "state_versions": _state_version,
    "contract_checks": _contract_check,
    "step_evidence": _step_evidence,
}


# --- plans (docs/plans.md): one mapper per record schema, since their topics carry several -------------------------

_FIRST_WINS = 1 << 63  # keep_first = this - submitted_at: the earliest submission of a plan id has the largest


def _plan_submitted(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    """A plan: its row and one row per subgoal (the DAG a reader draws)."""
    envelope = record["envelope"]
    session, plan_id, event_id = envelope["session_id"], record["plan_id"], str(envelope["event_id"])
    submitted = micros(envelope["event_time"])
    keep_first = _FIRST_WINS - submitted
    subgoals = record["subgoals"]
    rows: list[tuple[str, Row]] = [("plans", {
        "session_id": session, "plan_id": plan_id, "episode_id": envelope["episode_id"],
        "agent_id": envelope["agent_id"], "goal": record.get("goal", ""), "event_id": event_id,
        "subgoal_count": len(subgoals), "submitted_at": submitted, "keep_first": keep_first,
    })]  # fmt: skip
    for position, subgoal in enumerate(subgoals):
        profile, retry, fallback = subgoal["profile"], subgoal.get("retry") or {}, subgoal.get("fallback")
        spare = fallback or {}
        spare_profile = spare.get("profile") or {}
        rows.append(("plan_subgoals", {
            "session_id": session, "plan_id": plan_id, "subgoal_id": subgoal["subgoal_id"], "position": position,
            "event_id": event_id, "tool": subgoal.get("tool"), "agent": subgoal.get("agent"),
            "params_json": subgoal.get("params_json", "{}"), "resource_class": subgoal.get("resource_class", "cpu"),
            "gpu_memory_mb": int(profile.get("gpu_memory_mb", 0)), "gpus": int(profile.get("gpus", 0)),
            "cpu": int(profile.get("cpu", 1)), "deadline_s": float(subgoal["deadline_s"]),
            "max_attempts": int(retry.get("max_attempts", 1)), "backoff_s": float(retry.get("backoff_s", 0.0)),
            "backoff_multiplier": float(retry.get("backoff_multiplier", 2.0)),
            "has_fallback": int(fallback is not None),
            "fallback_tool": spare.get("tool"), "fallback_agent": spare.get("agent"),
            "fallback_params_json": spare.get("params_json"), "fallback_resource_class": spare.get("resource_class"),
            "fallback_gpu_memory_mb": int(spare_profile.get("gpu_memory_mb", 0)),
            "fallback_gpus": int(spare_profile.get("gpus", 0)), "fallback_cpu": int(spare_profile.get("cpu", 0)),
            "depends_on": list(subgoal.get("depends_on") or []), "submitted_at": submitted, "keep_first": keep_first,
        }))  # fmt: skip
    return rows


def _subgoal_status(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    envelope = record["envelope"]
    return [("subgoal_statuses", {
        "session_id": envelope["session_id"], "plan_id": record["plan_id"], "subgoal_id": record["subgoal_id"],
        "attempt": record["attempt"], "state": str(record["state"]), "executor_id": record.get("executor_id", ""),
        "output_ref": record.get("output_ref"), "error_class": record.get("error_class"), "error": record.get("error"),
        "event_id": str(envelope["event_id"]), "event_time": micros(envelope["event_time"]),
    })]  # fmt: skip


def _executor_heartbeat(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["executor_heartbeats"]}
    row["running"], row["valid_for_s"] = list(record["running"]), float(record["valid_for_s"])
    row["sent_at"] = micros(record["sent_at"])
    return [("executor_heartbeats", row)]


_DECISION_DEFAULTS: Row = {
    "subgoal_id": "", "attempt": 0, "next_attempt": None, "resource_class": "", "work_topic": "", "executor_id": None,
    "tool": None, "agent": None, "params_json": "", "gpu_memory_mb": 0, "gpus": 0, "cpu": 0, "deadline_s": 0.0,
    "fallback": 0, "error_class": "", "retry_at": None, "last_seen_at": None, "cancelled": [], "outcome": "",
    "succeeded": [], "escalated": [],
}  # fmt: skip


def _decision(kind_name: str, record: Mapping[str, Any], at: str, **fields: Any) -> list[tuple[str, Row]]:
    """One scheduler decision as a plan_decisions row: the columns its record has, the defaults for the rest."""
    row = {**_DECISION_DEFAULTS, "decision_id": record["decision_id"], "kind": kind_name,
           "session_id": record["session_id"], "episode_id": record["episode_id"], "plan_id": record["plan_id"],
           "subgoal_id": record.get("subgoal_id", ""), "decided_at": micros(record[at]), **fields}  # fmt: skip
    return [("plan_decisions", row)]


def _subgoal_released(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    profile = record["profile"]
    return _decision(
        "released", record, "released_at", attempt=record["attempt"], resource_class=record["resource_class"],
        work_topic=record["work_topic"], executor_id=record.get("executor_id"), tool=record.get("tool"),
        agent=record.get("agent"), params_json=record["params_json"], gpu_memory_mb=int(profile["gpu_memory_mb"]),
        gpus=int(profile["gpus"]), cpu=int(profile["cpu"]), deadline_s=float(record["deadline_s"]),
        fallback=int(bool(record.get("fallback"))),
    )  # fmt: skip


def _subgoal_retried(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return _decision("retried", record, "decided_at", attempt=record["failed_attempt"],
                     next_attempt=record["next_attempt"], error_class=record["error_class"],
                     retry_at=micros(record["retry_at"]))  # fmt: skip


def _subgoal_rerouted(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return _decision("rerouted", record, "decided_at", attempt=record["failed_attempt"],
                     next_attempt=record["next_attempt"], error_class=record["error_class"], tool=record.get("tool"),
                     agent=record.get("agent"))  # fmt: skip


def _subgoal_timed_out(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return _decision("timed_out", record, "decided_at", attempt=record["attempt"], error_class="timeout",
                     last_seen_at=micros(record["last_seen_at"]), deadline_s=float(record["deadline_s"]))  # fmt: skip


def _subgoal_escalated(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return _decision("escalated", record, "decided_at", attempt=record["attempts"], error_class=record["error_class"],
                     cancelled=list(record["cancelled"]))  # fmt: skip


def _plan_finished(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    return _decision("finished", record, "finished_at", attempt=record["attempts"], outcome=str(record["outcome"]),
                     succeeded=list(record["succeeded"]), escalated=list(record["escalated"]),
                     cancelled=list(record["cancelled"]))  # fmt: skip


def _scheduler_advice(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    row = {name: record[name] for name in TABLE_COLUMNS["scheduler_advice"]}
    row["action"] = str(record["action"])
    row["advised_at"], row["valid_until"] = micros(record["advised_at"]), micros(record["valid_until"])
    return [("scheduler_advice", row)]


def _release_delivered(kind: str, record: Mapping[str, Any]) -> list[tuple[str, Row]]:
    """No table: the marker only times the scheduler's deadline; the release itself is in plan_decisions."""
    return []


# Record schema -> mapper, for the topics that carry several schemas (rows_for's `schema_name`).
PLAN_ROWS: Mapping[str, Callable[[str, Mapping[str, Any]], list[tuple[str, Row]]]] = {
    PLAN_SUBMITTED: _plan_submitted,
    SUBGOAL_STATUS: _subgoal_status,
    EXECUTOR_HEARTBEAT: _executor_heartbeat,
    SUBGOAL_RELEASED: _subgoal_released,
    SUBGOAL_RETRIED: _subgoal_retried,
    SUBGOAL_REROUTED: _subgoal_rerouted,
    SUBGOAL_TIMED_OUT: _subgoal_timed_out,
    SUBGOAL_ESCALATED: _subgoal_escalated,
    PLAN_FINISHED: _plan_finished,
    SCHEDULER_ADVICE: _scheduler_advice,
    RELEASE_DELIVERED: _release_delivered,
}
