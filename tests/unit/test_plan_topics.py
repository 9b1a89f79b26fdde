"""Plan events on their one ordered log: the catalog routes the three input schemas to one topic and the six decisions
to another, the codec reads any schema a multi-schema topic carries (and refuses others), and the validator wants the
scheduler's key instead of the session's."""

from __future__ import annotations

import pytest

from processors.plans.dag import PlanScheduler
from sinks.rows import rows_for
from tests.unit.test_plans_dag import CODEC, heartbeat, marker, plan, status, subgoal
from topics.catalog import TopicCatalog, TopicRole, topic_expectation
from topics.codec import DeadLetterStage, DecodeError
from topics.names import (
    DISPATCH,
    EXECUTOR_HEARTBEAT,
    PLAN_DECISION_SCHEMAS,
    PLAN_EVENTS_KEY,
    PLAN_INPUT_SCHEMAS,
    PLAN_SUBMITTED,
    RELEASE_DELIVERED,
    SUBGOAL_STATUS,
)
from topics.publish_checks import publishable_topics
from topics.settings import Settings
from topics.validation import InputValidator

CATALOG = TopicCatalog(Settings(topic_prefix="t"))
KEY = PLAN_EVENTS_KEY.encode()


def test_each_plan_schema_has_one_topic_and_the_inputs_share_one_log() -> None:
    assert {CATALOG.for_schema(s).name for s in PLAN_INPUT_SCHEMAS} == {"t.plan_events"}
    assert {CATALOG.for_schema(s).name for s in PLAN_DECISION_SCHEMAS} == {"t.plan_decisions"}
    assert CATALOG["plan_events"].role is TopicRole.INPUT and CATALOG["plan_decisions"].role is TopicRole.OUTPUT
    assert set(CATALOG["plan_events"].schemas) == set(PLAN_INPUT_SCHEMAS)
    assert CATALOG["actions"].schemas == (DISPATCH,) and CATALOG["schemas"].schemas == ()
    published = publishable_topics(CATALOG)
    assert all(published[s] == "t.plan_decisions" for s in PLAN_DECISION_SCHEMAS)


def test_a_multi_schema_topic_reads_every_schema_it_carries_and_refuses_the_rest() -> None:
    expect = topic_expectation(CATALOG["plan_events"])
    assert isinstance(expect, frozenset)
    for schema, record in [
        (PLAN_SUBMITTED, plan("p", [subgoal("a")])),
        (SUBGOAL_STATUS, status("p", "a", 1, "RUNNING", 1)),
        (EXECUTOR_HEARTBEAT, heartbeat("x", 0)),
    ]:
        for _ in range(2):  # the second read takes the codec's fast path, which must keep the set apart
            assert CODEC.decode(CODEC.encode(schema, record), expect=expect)[0] == schema
    stray = CODEC.encode(PLAN_DECISION_SCHEMAS[0], _released())
    with pytest.raises(DecodeError, match="expected one of") as caught:
        CODEC.decode(stray, expect=expect)
    assert caught.value.stage is DeadLetterStage.SCHEMA
    assert topic_expectation(CATALOG["actions"]) == DISPATCH


def _released() -> dict:
    scheduler = PlanScheduler()
    scheduler.apply(EXECUTOR_HEARTBEAT, heartbeat("x", 0))
    (released,) = scheduler.apply(PLAN_SUBMITTED, plan("p", [subgoal("a")]))
    return released.record


def test_plan_events_are_keyed_by_the_scheduler_key_not_the_session() -> None:
    check = InputValidator().problem
    submitted = plan("p", [subgoal("a")])
    assert check(PLAN_SUBMITTED, submitted, KEY) is None
    assert "is not 'plans'" in check(PLAN_SUBMITTED, submitted, submitted["envelope"]["session_id"].encode())
    assert "is not 'plans'" in check(SUBGOAL_STATUS, status("p", "a", 1, "RUNNING", 1), None)
    assert check(EXECUTOR_HEARTBEAT, heartbeat("x", 0), KEY) is None
    assert "must not be empty" in check(EXECUTOR_HEARTBEAT, heartbeat("", 0), KEY)
    assert "event_time must be positive" in check(EXECUTOR_HEARTBEAT, {**heartbeat("x", 0), "sent_at": 0}, KEY)
    no_session = {**submitted, "envelope": {**submitted["envelope"], "session_id": ""}}
    assert check(PLAN_SUBMITTED, no_session, KEY) == "envelope.session_id is empty"


def test_a_release_delivered_marker_is_a_plan_event_the_processor_may_publish_and_no_table_takes() -> None:
    check = InputValidator().problem
    mark = marker("p", "a", 1, 3)
    assert CODEC.decode(CODEC.encode(RELEASE_DELIVERED, mark), expect=topic_expectation(CATALOG["plan_events"])) == (
        RELEASE_DELIVERED, mark,
    )  # fmt: skip
    assert publishable_topics(CATALOG)[RELEASE_DELIVERED] == "t.plan_events"
    assert check(RELEASE_DELIVERED, mark, KEY) is None
    assert "is not 'plans'" in check(RELEASE_DELIVERED, mark, b"s1")
    assert "must not be empty" in check(RELEASE_DELIVERED, {**mark, "decision_id": ""}, KEY)
    assert "attempt must be >= 1" in check(RELEASE_DELIVERED, {**mark, "attempt": 0}, KEY)
    assert rows_for("plan_events", mark, RELEASE_DELIVERED) == []  # the sink skips it, no rejected row
