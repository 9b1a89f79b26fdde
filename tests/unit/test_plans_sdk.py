"""The SDK's side of plans without a broker: subgoal models, the client-side refusals (the scheduler's own), the work
an executor receives, and what an executor advertises."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from pydantic import ValidationError

from processors.plans.dag import PlanScheduler, attempt_key
from streams.sdk.executor import Executor, ExecutorConfig, free_capacity
from streams.sdk.plans import Fallback, ResourceProfile, RetryPolicy, Subgoal, SubgoalWork, plan_subgoals
from topics.codec import AvroCodec
from topics.names import EXECUTOR_HEARTBEAT, PLAN_SUBMITTED, SUBGOAL_RELEASED
from topics.plan_checks import PlanRefused

NOW = 1_800_000_000_000_000


def envelope(plan_id: str) -> dict[str, Any]:
    return {
        "event_id": "e", "session_id": "s", "agent_id": "a", "episode_id": "ep", "logical_event_id": plan_id,
        "seq": 0, "event_time": NOW, "policy_version": "", "trace_id": "", "attributes": {},
    }  # fmt: skip


def test_a_subgoal_becomes_the_plan_submitted_record_the_codec_takes() -> None:
    subgoals = [
        Subgoal(id="a", tool="search", params={"q": "x", "n": 2}),
        Subgoal(
            id="b", agent="writer", resource_class="gpu.a100", profile=ResourceProfile(gpu_memory_mb=8000, gpus=1),
            deadline_s=5.5, retry=RetryPolicy(max_attempts=3, backoff_s=1.0),
            fallback=Fallback(tool="small", params={"k": 1}, profile=ResourceProfile(cpu=2)), depends_on=["a"],
        ),
    ]  # fmt: skip
    records = plan_subgoals("p", subgoals)
    record = {"envelope": envelope("p"), "plan_id": "p", "goal": "g", "subgoals": records}
    codec = AvroCodec()
    _, decoded = codec.decode(codec.encode(PLAN_SUBMITTED, record), expect=PLAN_SUBMITTED)
    assert decoded["subgoals"] == records
    assert records[1]["fallback"] == {
        "tool": "small", "agent": None, "params_json": '{"k":1}', "resource_class": "cpu",
        "profile": {"gpu_memory_mb": 0, "gpus": 0, "cpu": 2},
    }  # fmt: skip
    assert plan_subgoals("p", [{"id": "a", "tool": "search", "params": {"q": "x", "n": 2}}]) == records[:1]


def test_a_resource_class_that_cannot_name_a_topic_is_refused() -> None:
    with pytest.raises(ValidationError, match="resource_class"):
        Subgoal(id="a", resource_class="gpu/a100")
    with pytest.raises(ValueError, match="names the work topic"):
        ExecutorConfig(resource_class="has space")


ids = st.sampled_from(["a", "b", "c", "d", ""])


@given(
    st.lists(
        st.tuples(ids, st.lists(st.sampled_from(["a", "b", "c", "d", "x"]), max_size=3), st.integers(-1, 2)),
        max_size=5,
    ),
    st.sampled_from(["plan", ""]),
)
@hypothesis_settings(deadline=None)
def test_the_sdk_refuses_a_plan_exactly_when_the_scheduler_would_and_for_the_same_reason(
    nodes: list[tuple[str, list[str], int]], plan_id: str
) -> None:
    subgoals = [
        {"id": sid, "depends_on": deps, "retry": {"max_attempts": attempts}} for sid, deps, attempts in nodes
    ]  # fmt: skip
    try:
        records = [Subgoal.model_validate(s).record() for s in subgoals]
    except ValidationError:
        return
    sdk_reason = scheduler_reason = None
    try:
        plan_subgoals(plan_id, subgoals)
    except PlanRefused as refused:
        sdk_reason = refused.reason
    try:
        PlanScheduler().apply(
            PLAN_SUBMITTED, {"envelope": envelope(plan_id), "plan_id": plan_id, "goal": "", "subgoals": records}
        )
    except PlanRefused as refused:
        scheduler_reason = refused.reason
    assert sdk_reason == scheduler_reason


@functools.cache
def released_record() -> dict[str, Any]:
    scheduler = PlanScheduler(work_topic_prefix="t.work")
    scheduler.apply(
        EXECUTOR_HEARTBEAT,
        {
            "executor_id": "ex", "resource_class": "cpu", "free_gpu_memory_mb": 0, "free_gpus": 0, "free_cpu": 4,
            "running": [], "valid_for_s": 30.0, "host": "", "sent_at": NOW,
        },
    )  # fmt: skip
    plan = {
        "envelope": envelope("p"), "plan_id": "p", "goal": "",
        "subgoals": plan_subgoals("p", [Subgoal(id="a", tool="t", params={"x": [1, 2]}, deadline_s=2.5)]),
    }  # fmt: skip
    (decision,) = [d for d in scheduler.apply(PLAN_SUBMITTED, plan) if d.schema == SUBGOAL_RELEASED]
    codec = AvroCodec()
    return codec.decode(codec.encode(SUBGOAL_RELEASED, decision.record), expect=SUBGOAL_RELEASED)[1]


def test_subgoal_work_is_the_released_record_with_params_parsed() -> None:
    record = dict(released_record())
    work = SubgoalWork.from_record(record)
    assert (work.work_topic, work.executor_id, work.tool, work.params) == ("t.work.cpu", "ex", "t", {"x": [1, 2]})
    assert work.attempt_key == attempt_key("s", "p", "a", 1)
    assert work.expires_at == record["released_at"] + 2_500_000
    assert work.received_at is None  # read by no executor
    assert SubgoalWork.from_record(record, received_at=123).received_at == 123
    # sent later than released (a scheduler catching up on a backlog): the deadline runs from the send, as the
    # scheduler's does from its ReleaseDelivered marker
    late = SubgoalWork.from_record(record, sent_at=record["released_at"] + 60_000_000)
    assert late.expires_at == record["released_at"] + 62_500_000
    assert SubgoalWork.from_record(record, sent_at=record["released_at"] - 1).expires_at == work.expires_at


profiles = st.builds(ResourceProfile, gpu_memory_mb=st.integers(0, 5000), gpus=st.integers(0, 2), cpu=st.integers(0, 4))


@given(
    st.integers(0, 20_000), st.integers(0, 4), st.integers(0, 8), st.none() | st.integers(1, 4),
    st.lists(profiles, max_size=5), st.none() | st.integers(-10, 30_000),
)  # fmt: skip
@hypothesis_settings(deadline=None)
def test_an_executor_advertises_its_budget_less_what_it_holds_capped_by_the_device(
    memory: int, gpus: int, cpu: int, max_concurrent: int | None, held: list[ResourceProfile], probe: int | None
) -> None:
    config = ExecutorConfig(
        resource_class="c", executor_id="e", gpu_memory_mb=memory, gpus=gpus, cpu=cpu, max_concurrent=max_concurrent
    )
    work = SubgoalWork.from_record(released_record())
    attempts = [work.model_copy(update={"profile": p}) for p in held]
    free = free_capacity(config, attempts, probe)
    if max_concurrent is not None and len(held) >= max_concurrent:
        assert free == (0, 0, 0)
        return
    used = [sum(getattr(p, f) for p in held) for f in ("gpu_memory_mb", "gpus", "cpu")]
    expected = [max(0, budget - u) for budget, u in zip((memory, gpus, cpu), used, strict=True)]
    if probe is not None:
        expected[0] = min(expected[0], max(0, probe))
    assert free == tuple(expected)


def test_an_executor_needs_a_handler_and_one_way_of_configuring_it() -> None:
    async def handler(work: SubgoalWork, ctx: Any) -> None:
        return None

    with pytest.raises(TypeError, match="handler"):
        Executor(resource_class="cpu")
    with pytest.raises(TypeError, match="not both"):
        Executor(handler=handler, config=ExecutorConfig(resource_class="cpu"), cpu=2)
    with pytest.raises(ValueError, match="max_concurrent"):
        Executor(resource_class="cpu", handler=handler, max_concurrent=0)
    executor = Executor(resource_class="gpu", handler=handler, executor_id="box-1")
    assert executor.work_topic == f"{executor.settings.topic_prefix}.work.gpu"
    assert executor.group_id == f"{executor.settings.topic_prefix}.executor.box-1"
    assert executor._is_async


def test_two_executors_of_one_process_get_two_ids() -> None:
    first, second = ExecutorConfig(resource_class="c"), ExecutorConfig(resource_class="c")
    assert first.executor_id != second.executor_id
    assert first.executor_id.rsplit("-", 2)[1] == str(os.getpid())
