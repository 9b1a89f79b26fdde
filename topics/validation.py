"""Checks at the processor boundary for records that decoded but must not be folded in.

Producers that bypass the SDK (any language can write the topics) can send schema-valid nonsense;
each problem found here sends the record to dead letters with a reason instead of into a step.
"""

from __future__ import annotations

from typing import Any

from topics.event_checks import (
    MAX_NAME_CHARS,
    event_time_problem,
    latency_problem,
    llm_call_problem,
    overlong_name_problem,
    reward_problem,
)
from topics.json_budget import json_depth_problem
from topics.names import (
    DISPATCH,
    EXECUTOR_HEARTBEAT,
    LLM_CALL,
    PLAN_EVENTS_KEY,
    PLAN_INPUT_SCHEMAS,
    RELEASE_DELIVERED,
    REWARD,
    SCHEDULER_ADVICE,
    STATE_DELTA,
    TOOL_RESULT,
)
from topics.tool_schemas import ToolSchemas

_REQUIRED_ENVELOPE = ("event_id", "session_id", "logical_event_id")


class InputValidator:
    def __init__(self, tool_schemas: ToolSchemas | None = None) -> None:
        self.tool_schemas = tool_schemas or ToolSchemas()

    def problem(
        self, schema_name: str, record: dict[str, Any], key: bytes | None, encoded_bytes: int | None = None
    ) -> str | None:
        """Why the record is invalid, or None. `encoded_bytes`: its encoded size, if known (a record that small cannot
        hold an overlong id, so those checks are skipped)."""
        if schema_name in PLAN_INPUT_SCHEMAS:
            return _plan_event_problem(schema_name, record, key)
        env = record.get("envelope")
        if not isinstance(env, dict):
            return "record has no envelope"
        for name in _REQUIRED_ENVELOPE:
            if not env.get(name):
                return f"envelope.{name} is empty"
        overlong = encoded_bytes is None or encoded_bytes > MAX_NAME_CHARS  # else no id can be that long
        if overlong and (problem := overlong_name_problem(record)) is not None:
            return problem
        if key is None:
            return (
                f"the message has no key; events must be keyed by envelope.session_id ({env['session_id']!r}) so a "
                "session stays in one partition"
            )
        if key.decode("utf-8", "replace") != env["session_id"]:
            return (
                f"message key {key[:64]!r} differs from envelope.session_id {env['session_id']!r}; "
                "events must be keyed by session_id so a session stays in one partition"
            )
        if (problem := event_time_problem(env["event_time"])) is not None:
            return problem
        if schema_name == DISPATCH:
            if record["step"] < 0:
                return f"step must be >= 0, got {record['step']}"
            return self.tool_schemas.error_in_json(record["tool"], record["params_json"])
        if schema_name == TOOL_RESULT:
            return latency_problem(record["latency_ms"])
        if schema_name == REWARD:
            return reward_problem(record["value"], record["confidence"])
        if schema_name == STATE_DELTA:
            return _state_delta_problem(record)
        if schema_name == LLM_CALL:
            return llm_call_problem(record)
        return None


def _plan_event_problem(schema_name: str, record: dict[str, Any], key: bytes | None) -> str | None:
    """Plan events share one key, not the session's: the scheduler reads them as one ordered log."""
    if key is None or key.decode("utf-8", "replace") != PLAN_EVENTS_KEY:
        return (
            f"message key {key[:64] if key else None!r} is not {PLAN_EVENTS_KEY!r}; plan events are keyed "
            f"{PLAN_EVENTS_KEY!r} so the scheduler reads them in one order"
        )
    if schema_name == EXECUTOR_HEARTBEAT:
        if not record["executor_id"] or not record["resource_class"]:
            return "executor_id and resource_class must not be empty"
        return event_time_problem(record["sent_at"])
    if schema_name == SCHEDULER_ADVICE:
        if not record["tool"] or not record["params_hash"] or not record["advice_id"]:
            return "advice_id, tool and params_hash must not be empty"
        if record["valid_until"] < record["advised_at"]:
            return "valid_until is before advised_at"
        return event_time_problem(record["advised_at"])
    if schema_name == RELEASE_DELIVERED:
        if not record["decision_id"] or not record["session_id"] or not record["plan_id"] or not record["subgoal_id"]:
            return "decision_id, session_id, plan_id and subgoal_id must not be empty"
        if record["attempt"] < 1:
            return f"attempt must be >= 1, got {record['attempt']}"
        return event_time_problem(record["sent_at"])
    env = record["envelope"]
    for name in _REQUIRED_ENVELOPE:
        if not env.get(name):
            return f"envelope.{name} is empty"
    return event_time_problem(env["event_time"])


def _state_delta_problem(record: dict[str, Any]) -> str | None:
    """A node or edge whose data_json nests too deep for the state processor to parse."""
    for i, node in enumerate(record["node_upserts"]):
        if (problem := json_depth_problem(f"node_upserts[{i}].data_json", node["data_json"])) is not None:
            return problem
    for i, edge in enumerate(record["edge_upserts"]):
        if (problem := json_depth_problem(f"edge_upserts[{i}].data_json", edge["data_json"])) is not None:
            return problem
    return None
