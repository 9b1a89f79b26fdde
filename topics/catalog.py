"""The topic catalog: every topic treadle reads or writes, with its key, value schema and retention.

Input and output topics are co-partitioned on session_id (same partition count, same key), because
the step assembler's state for a session lives in the partition that session hashes to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from topics.names import (
    CONTRACT_CHECK,
    DEAD_LETTER,
    DISPATCH,
    EVALUATION_METRIC,
    LATE_REWARD,
    LIFECYCLE,
    LLM_CALL,
    PLAN_DECISION_SCHEMAS,
    PLAN_EVENTS_KEY,
    PLAN_INPUT_SCHEMAS,
    RESOURCE_SAMPLE,
    REWARD,
    STATE_DELTA,
    STATE_VERSION,
    STEP_EVIDENCE,
    SUBGOAL_RELEASED,
    TOOL_RESULT,
    TRANSITION,
    WOVEN_REWARD,
)
from topics.settings import Settings


class TopicRole(StrEnum):
    INPUT = "input"
    OUTPUT = "output"
    INTERNAL = "internal"


@dataclass(frozen=True)
class TopicSpec:
    """One topic: `name` is the full topic name, `kind` the short name code refers to. Most topics carry one record
    schema (`value_schema`); a log that must keep one order across record types also carries `also_carries`."""

    kind: str
    name: str
    role: TopicRole
    value_schema: str | None
    key: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)
    doc: str = ""
    also_carries: tuple[str, ...] = ()

    @property
    def schemas(self) -> tuple[str, ...]:
        """Every record schema the topic carries (none for an internal JSON topic)."""
        return ((self.value_schema,) if self.value_schema else ()) + self.also_carries


_WEEK_MS = str(7 * 24 * 3600 * 1000)
_DELETE = {"cleanup.policy": "delete", "retention.ms": _WEEK_MS}
_KEEP = {"cleanup.policy": "delete", "retention.ms": "-1"}

# kind, schema, role, config, doc (the further schemas of a multi-schema topic are in _ALSO_CARRIES)
_TOPICS: list[tuple[str, str | None, TopicRole, dict[str, str], str]] = [
    ("actions", DISPATCH, TopicRole.INPUT, _DELETE, "Agents' tool calls; each opens a step."),
    ("tool_results", TOOL_RESULT, TopicRole.INPUT, _DELETE, "Outcomes of tool calls."),
    ("rewards", REWARD, TopicRole.INPUT, _DELETE, "Reward signals from any source."),
    ("state_deltas", STATE_DELTA, TopicRole.INPUT, _DELETE, "Changes to the state graph."),
    ("lifecycle", LIFECYCLE, TopicRole.INPUT, _DELETE, "Session and episode phases."),
    (
        "llm_calls",
        LLM_CALL,
        TopicRole.INPUT,
        _DELETE,
        "Model calls inside steps: prompt, completion, token ids, logprobs (for training triplets).",
    ),
    ("transitions", TRANSITION, TopicRole.OUTPUT, _DELETE, "Replay rows, one per step revision."),
    ("woven_rewards", WOVEN_REWARD, TopicRole.OUTPUT, _DELETE, "Fused rewards per revision."),
    ("dead_letters", DEAD_LETTER, TopicRole.OUTPUT, _KEEP, "Inputs that could not be processed."),
    ("state_versions", STATE_VERSION, TopicRole.OUTPUT, _DELETE, "State-graph versions and changes."),
    (
        "evaluation_metrics",
        EVALUATION_METRIC,
        TopicRole.OUTPUT,
        _DELETE,
        "Metric rows from evaluator processors (e.g. safety alerts).",
    ),
    (
        "late_rewards",
        LATE_REWARD,
        TopicRole.OUTPUT,
        _KEEP,
        "Rewards not woven into a step: after grace, or orphans; with lateness and reason.",
    ),
    (
        "resource_samples",
        RESOURCE_SAMPLE,
        TopicRole.OUTPUT,
        _DELETE,
        "GPU telemetry from workers (NVML), keyed by host, not by session.",
    ),
    (
        "contract_checks",
        CONTRACT_CHECK,
        TopicRole.OUTPUT,
        _DELETE,
        "Contract checks: per step, contract and phase, passed / violated / not evaluable, with clause and values.",
    ),
    (
        "step_evidence",
        STEP_EVIDENCE,
        TopicRole.OUTPUT,
        _DELETE,
        "Provenance: SHA-256 of each dispatch and tool result as received, with its envelope attributes.",
    ),
    (
        "plan_events",
        PLAN_INPUT_SCHEMAS[0],
        TopicRole.INPUT,
        _DELETE,
        f"Plans submitted, subgoal statuses, executor heartbeats, self-diagnosis advice and release-delivered markers: "
        f"the plans scheduler's one ordered log (key {PLAN_EVENTS_KEY!r}).",
    ),
    (
        "plan_decisions",
        PLAN_DECISION_SCHEMAS[0],
        TopicRole.OUTPUT,
        _DELETE,
        "The plans scheduler's decisions: released, retried, rerouted, timed out, escalated, plan finished.",
    ),
    (
        "reward_policies",
        None,
        TopicRole.INTERNAL,
        {"cleanup.policy": "compact", "retention.ms": "-1"},
        "Reward policies: version -> policy JSON (`treadle policy push`).",
    ),
    (
        "node_types",
        None,
        TopicRole.INTERNAL,
        {"cleanup.policy": "compact", "retention.ms": "-1"},
        "State-graph node types: node/<type>/<hash> -> JSON Schema (python -m topics.node_types).",
    ),
    (
        "contracts",
        None,
        TopicRole.INTERNAL,
        {"cleanup.policy": "compact", "retention.ms": "-1"},
        "Action contracts: contract/<name>/<version> -> contract JSON (`treadle contracts register`).",
    ),
    (
        "schemas",
        None,
        TopicRole.INTERNAL,
        {"cleanup.policy": "compact", "retention.ms": "-1"},
        "Schema registry: fingerprint -> {subject, version, schema}.",
    ),
]
_ALSO_CARRIES = {"plan_events": PLAN_INPUT_SCHEMAS[1:], "plan_decisions": PLAN_DECISION_SCHEMAS[1:]}
_KEYS = {"plan_events": f"{PLAN_EVENTS_KEY!r} (one partition, one order)"}


class TopicCatalog:
    """The deployment's topics, derived from settings (prefix, partitions, replication)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._specs = {
            kind: TopicSpec(
                kind=kind,
                name=f"{settings.topic_prefix}.{kind}"
                if role is not TopicRole.INTERNAL
                else f"_{settings.topic_prefix}.{kind}",
                role=role,
                value_schema=schema,
                key=_KEYS.get(kind, "session_id" if role is not TopicRole.INTERNAL else "schema fingerprint"),
                partitions=settings.partitions if role is not TopicRole.INTERNAL else 1,
                replication_factor=settings.replication_factor,
                config=dict(config),
                doc=doc,
                also_carries=_ALSO_CARRIES.get(kind, ()),
            )
            for kind, schema, role, config, doc in _TOPICS
        }

    def __getitem__(self, kind: str) -> TopicSpec:
        return self._specs[kind]

    def __iter__(self):
        return iter(self._specs.values())

    def by_role(self, role: TopicRole) -> list[TopicSpec]:
        return [s for s in self._specs.values() if s.role is role]

    def by_name(self, name: str) -> TopicSpec | None:
        return next((s for s in self._specs.values() if s.name == name), None)

    @property
    def inputs(self) -> list[TopicSpec]:
        return self.by_role(TopicRole.INPUT)

    def for_schema(self, schema_name: str) -> TopicSpec:
        """The topic that carries `schema_name` (each schema is on one topic)."""
        for spec in self._specs.values():
            if schema_name in spec.schemas:
                return spec
        raise KeyError(f"no topic carries {schema_name}")


def topic_expectation(spec: TopicSpec) -> str | frozenset[str] | None:
    """What AvroCodec.decode should expect of a record on `spec`'s topic: its schema, or the set a multi-schema topic
    carries."""
    return frozenset(spec.schemas) if spec.also_carries else spec.value_schema


def work_topic_spec(settings: Settings, resource_class: str) -> TopicSpec:
    """The work topic of one resource class, `<prefix>.work.<resource_class>`: the plans scheduler releases the class's
    SubgoalReleased records to it (keyed by session) and each executor of the class reads all of it. Not in the
    catalog: there is one per resource class, made on demand by whoever needs it first (ensure_topics([spec]))."""
    return TopicSpec(
        kind=f"work.{resource_class}",
        name=f"{settings.topic_prefix}.work.{resource_class}",
        role=TopicRole.OUTPUT,
        value_schema=SUBGOAL_RELEASED,
        key="session_id",
        partitions=settings.partitions,
        replication_factor=settings.replication_factor,
        config=dict(_DELETE),
        doc=f"Work released to the executors of resource class {resource_class!r}.",
    )
