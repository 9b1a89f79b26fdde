"""Plans from the SDK's side: the subgoals a planner submits and the work an executor receives.

`Subgoal` (with `ResourceProfile`, `RetryPolicy`, `Fallback`) is what `AgentStream.submit_plan` takes; it becomes a
PlanSubmitted record, checked first by the scheduler's own refusals (`topics.plan_checks.validate_plan`), so a cyclic
or malformed plan fails in the caller with the reason the scheduler would dead-letter it with. `SubgoalWork` is one
released attempt (a SubgoalReleased record) as an `Executor`'s handler sees it. docs/plans.md has the semantics.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from topics.plan_checks import Resources, attempt_key, validate_plan

RESOURCE_CLASS_PATTERN = r"^[A-Za-z0-9._-]{1,200}$"  # it names a Kafka topic, <prefix>.work.<resource_class>
MICROS = 1_000_000


class ResourceProfile(BaseModel):
    """What one attempt holds while it runs: GPU memory (MiB), whole GPUs and CPU slots."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_memory_mb: int = 0
    gpus: int = 0
    cpu: int = 1


class RetryPolicy(BaseModel):
    """Attempts of the subgoal (and again of its fallback), with event-time backoff between them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = 1
    backoff_s: float = 0.0
    backoff_multiplier: float = 2.0


class Fallback(BaseModel):
    """What runs instead once the subgoal's attempts are spent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tool: str | None = None
    agent: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    resource_class: str = Field("cpu", pattern=RESOURCE_CLASS_PATTERN)
    profile: ResourceProfile = ResourceProfile()

    def record(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "agent": self.agent,
            "params_json": _params_json(self.params),
            "resource_class": self.resource_class,
            "profile": self.profile.model_dump(),
        }


class Subgoal(BaseModel):
    """One node of a plan's DAG: what to run (a tool or an agent), where (resource class, profile), how long an
    attempt may go without a sign of life (`deadline_s`), how it is retried, its fallback and what it waits for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    tool: str | None = None
    agent: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    resource_class: str = Field("cpu", pattern=RESOURCE_CLASS_PATTERN)
    profile: ResourceProfile = ResourceProfile()
    deadline_s: float = 60.0
    retry: RetryPolicy = RetryPolicy()
    fallback: Fallback | None = None
    depends_on: Sequence[str] = ()

    def record(self) -> dict[str, Any]:
        """The PlanSubmitted Subgoal record."""
        return {
            "subgoal_id": self.id,
            "tool": self.tool,
            "agent": self.agent,
            "params_json": _params_json(self.params),
            "resource_class": self.resource_class,
            "profile": self.profile.model_dump(),
            "deadline_s": float(self.deadline_s),
            "retry": self.retry.model_dump(),
            "fallback": self.fallback.record() if self.fallback is not None else None,
            "depends_on": list(self.depends_on),
        }


def plan_subgoals(plan_id: str, subgoals: Iterable[Subgoal | dict[str, Any]]) -> list[dict[str, Any]]:
    """The Subgoal records of a plan, refused (PlanRefused) exactly as the scheduler would refuse them.

    `subgoals`: `Subgoal`s, or dicts of its fields (validated into one)."""
    records = [(s if isinstance(s, Subgoal) else Subgoal.model_validate(s)).record() for s in subgoals]
    validate_plan(plan_id, records)
    return records


class SubgoalWork(BaseModel):
    """One released attempt of a subgoal, as an executor's handler receives it (a SubgoalReleased record)."""

    model_config = ConfigDict(frozen=True)

    decision_id: str
    session_id: str
    episode_id: str
    plan_id: str
    subgoal_id: str
    attempt: int
    resource_class: str
    work_topic: str
    executor_id: str | None = None
    tool: str | None = None
    agent: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    profile: ResourceProfile = ResourceProfile()
    deadline_s: float
    fallback: bool = False
    released_at: int  # scheduler event time, UTC micros
    # UTC micros at which the executor read the record from its work topic (None when not read by an executor):
    # received_at - released_at is the release's way to the executor (plus any clock skew between the hosts)
    received_at: int | None = None
    sent_at: int = 0  # when the release was written to the work topic (its record's timestamp), UTC micros; 0: unknown

    @classmethod
    def from_record(cls, record: dict[str, Any], *, received_at: int | None = None, sent_at: int = 0) -> SubgoalWork:
        """From a decoded SubgoalReleased record (params_json parsed), written to the work topic at `sent_at` (its
        record's timestamp) and read by an executor at `received_at`."""
        fields = {k: v for k, v in record.items() if k != "params_json"}
        params = json.loads(record.get("params_json") or "{}")
        return cls.model_validate({**fields, "params": params, "received_at": received_at, "sent_at": sent_at})

    @property
    def attempt_key(self) -> str:
        """How heartbeats and the scheduler name the attempt: session_id/plan_id/subgoal_id/attempt."""
        return attempt_key(self.session_id, self.plan_id, self.subgoal_id, self.attempt)

    @property
    def resources(self) -> Resources:
        """What the attempt holds of an executor's budget while it runs."""
        return Resources(self.profile.gpu_memory_mb, self.profile.gpus, self.profile.cpu)

    @property
    def expires_at(self) -> int:
        """UTC micros at which the scheduler times the attempt out if nothing was heard of it since it was sent: its
        deadline runs from its ReleaseDelivered marker, written right after the release was sent (a release made
        while the scheduler caught up on a backlog carries an older `released_at`)."""
        return max(self.released_at, self.sent_at) + round(self.deadline_s * MICROS)


def _params_json(params: dict[str, Any]) -> str:
    try:
        return json.dumps(params, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"params are not JSON-serializable: {exc}") from exc
