"""Fuzzing one live worker: thousands of random and mutated records mixed with good steps (issue 25).

Hypothesis draws the records (random bytes; valid encodings truncated or with bits flipped; valid schemas with hostile
field values), all sent to ONE worker on the sessions, and so the partitions, of the good steps. Then: the worker
still runs, every bad record is a dead letter with a stage and a reason, and every good step is a correct transition.
Which records are bad is decided per record by the class it was drawn from and, for bit flips (which may still make
a valid event), by the same Intake the worker runs, read here in the test process.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from sinks.sql_client import run_sql
from tests.factories import KIND_OF, dispatch, result, reward, wait_for
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.ids import uuid7
from topics.intake import Intake, Rejected, SourceMessage
from topics.settings import Settings
from topics.validation import InputValidator

DISPATCH, RESULT, REWARD = "treadle.events.ActionDispatched", "treadle.events.ToolResult", "treadle.events.RewardSignal"
SESSIONS = [f"fz-{i}" for i in range(8)]
CODEC = AvroCodec()
_seq = itertools.count(1)


@dataclass
class Sent:
    kind: str  # topic kind
    key: bytes | None
    value: bytes | None
    expected: str | None  # the stage its class implies; None: decided by the intake (bit flips)


def _valid(schema: str, session: str, lid: str, seq: int | None = None) -> dict[str, Any]:
    """A valid record; `seq` fixed for drawn ones, so a draw's bytes (their length) never depend on earlier draws."""
    seq = next(_seq) if seq is None else seq
    if schema == DISPATCH:
        return dispatch(session, lid, 0, seq)
    if schema == RESULT:
        return result(session, lid, seq)
    return reward(session, lid, seq, 0.5)


@st.composite
def valid_encoding(draw: st.DrawFn) -> tuple[str, str, bytes]:
    schema = draw(st.sampled_from([DISPATCH, RESULT, REWARD]))
    session = draw(st.sampled_from(SESSIONS))
    lid = f"bad-{draw(st.uuids(version=4))}"  # drawn, not uuid7(): hypothesis replays a draw and needs the same bytes
    return schema, session, CODEC.encode(schema, _valid(schema, session, lid, seq=1_000_000))


@st.composite
def random_bytes(draw: st.DrawFn) -> Sent:
    value = draw(st.binary(max_size=300))
    kind = draw(st.sampled_from(list(KIND_OF.values())))
    stage = None if value[:2] == b"\xc3\x01" else "DECODE"
    return Sent(kind, draw(st.sampled_from(SESSIONS)).encode(), value, stage)


@st.composite
def truncated(draw: st.DrawFn) -> Sent:
    schema, session, value = draw(valid_encoding())
    keep = draw(st.integers(0, len(value) - 1))
    return Sent(KIND_OF[schema], session.encode(), value[:keep], None)


@st.composite
def bit_flipped(draw: st.DrawFn) -> Sent:
    schema, session, value = draw(valid_encoding())
    flipped = bytearray(value)
    for position in draw(st.lists(st.integers(0, len(value) * 8 - 1), min_size=1, max_size=4)):
        flipped[position // 8] ^= 1 << (position % 8)
    return Sent(KIND_OF[schema], session.encode(), bytes(flipped), None)


HOSTILE = [
    "deep_params", "not_json", "not_object", "negative_step", "empty_session", "bad_time", "bad_reward_value",
    "bad_confidence", "bad_latency", "key_mismatch", "no_key", "tombstone", "control_chars_deep",
]  # fmt: skip


@st.composite
def hostile(draw: st.DrawFn) -> Sent:
    """A schema-valid record with a value the contract forbids: always VALIDATE (tombstones: DECODE)."""
    how = draw(st.sampled_from(HOSTILE))
    session = draw(st.sampled_from(SESSIONS))
    lid = f"bad-{draw(st.uuids(version=4))}"
    key: bytes | None = session.encode()
    schema = {"bad_reward_value": REWARD, "bad_confidence": REWARD, "bad_latency": RESULT}.get(how, DISPATCH)
    record = _valid(schema, session, lid, seq=1_000_000)
    if how == "deep_params":
        depth = draw(st.one_of(st.sampled_from([65, 1_000, 5_000, 20_000]), st.integers(65, 6_000)))
        record["params_json"] = "[" * depth + "]" * depth
    elif how == "control_chars_deep":
        depth = draw(st.integers(65, 500))
        text = draw(st.text(max_size=20))
        record["params_json"] = '{"a": ' + '["\\u0000' + text.replace("\\", "").replace('"', "") + '", ' * depth + "1"
    elif how == "not_json":
        record["params_json"] = "{" + draw(st.text(max_size=50))
    elif how == "not_object":
        record["params_json"] = draw(st.sampled_from(["[1, 2]", "5", '"s"', "null", "true"]))
    elif how == "negative_step":
        record["step"] = draw(st.integers(-(2**40), -1))
    elif how == "empty_session":
        record["envelope"]["session_id"] = ""
    elif how == "bad_time":
        record["envelope"]["event_time"] = draw(st.integers(-(2**62), 0))
    elif how == "bad_reward_value":
        record["value"] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    elif how == "bad_confidence":
        record["confidence"] = draw(st.one_of(st.floats(1.0001, 1e300), st.floats(-1e300, -0.0001), st.just(math.nan)))
    elif how == "bad_latency":
        record["latency_ms"] = draw(st.one_of(st.floats(-1e300, -0.001), st.just(math.nan), st.just(math.inf)))
    elif how == "key_mismatch":
        key = draw(st.binary(min_size=1, max_size=40).filter(lambda k: k != session.encode()))
    elif how == "no_key":
        key = None
    value = None if how == "tombstone" else CODEC.encode(schema, record)
    return Sent(KIND_OF[schema], key, value, "DECODE" if how == "tombstone" else "VALIDATE")


BAD = st.one_of(random_bytes(), truncated(), bit_flipped(), hostile())


@dataclass
class GoodStep:
    session: str
    lid: str
    reward: float


def good_step(session: str, value: float) -> tuple[GoodStep, list[tuple[str, dict]]]:
    lid = uuid7()
    events = [
        (DISPATCH, dispatch(session, lid, 0, next(_seq))),
        (RESULT, result(session, lid, next(_seq))),
        (REWARD, reward(session, lid, next(_seq), value)),
    ]
    return GoodStep(session, lid, value), events


def expected_stage(intake: Intake, catalog: TopicCatalog, sent: Sent) -> str | None:
    """The stage the worker must dead-letter `sent` with, or None for a record that is a valid event after all."""
    read = intake.read(SourceMessage(catalog[sent.kind].name, 0, 0, sent.key, sent.value, 1))
    if not isinstance(read, Rejected):
        assert sent.expected is None, ("a record of a bad class was read as valid", sent)
        return None
    stage = read.dead_letter["stage"]
    assert sent.expected in (None, stage), (sent, read.dead_letter["reason"])
    return stage


async def produce(settings: Settings, plan: list[Sent | tuple[str, dict]]) -> list[tuple[Sent, str, int, int]]:
    """Send everything in order; returns each bad record with its topic, partition and offset."""
    catalog = TopicCatalog(settings)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = []
        for item in plan:
            if isinstance(item, Sent):
                futures.append((item, await producer.send(catalog[item.kind].name, item.value, key=item.key)))
            else:
                schema, record = item
                value, key = CODEC.encode(schema, record), record["envelope"]["session_id"].encode()
                await producer.send(catalog[KIND_OF[schema]].name, value, key=key)
        await producer.flush()
        placed = []
        for sent, future in futures:
            metadata = await future
            placed.append((sent, metadata.topic, metadata.partition, metadata.offset))
        return placed
    finally:
        await producer.stop()


def test_a_live_worker_survives_thousands_of_bad_records_and_weaves_every_good_step(
    deployment: Settings, worker_factory
) -> None:
    settings = deployment
    worker = worker_factory(settings).start()
    worker.wait_ready()
    plan: list[Sent | tuple[str, dict]] = []
    good: list[GoodStep] = []

    @hypothesis_settings(
        max_examples=100, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(bad=st.lists(BAD, min_size=22, max_size=30), value=st.floats(-1.0, 1.0), session=st.sampled_from(SESSIONS))
    def draw_batch(bad: list[Sent], value: float, session: str) -> None:
        step, events = good_step(session, value)
        good.append(step)
        plan.extend(bad[: len(bad) // 2])
        plan.extend(events)  # good events between bad ones, on the sessions (partitions) the bad ones use
        plan.extend(bad[len(bad) // 2 :])

    draw_batch()
    for size in (899_990, 950_000, 1_000_000):  # near and over the limit (the broker takes ~1 MiB)
        over = result(SESSIONS[0], f"bad-{uuid7()}", next(_seq))
        over["output"] = "z" * size
        value = CODEC.encode(RESULT, over)
        plan.append(Sent("tool_results", SESSIONS[0].encode(), value, None if len(value) <= 900_000 else "VALIDATE"))

    catalog = TopicCatalog(settings)
    intake = Intake(CODEC, catalog, InputValidator())
    placed = asyncio.run(produce(settings, plan))
    expected = {
        f"{topic}/{partition}/{offset}": stage
        for sent, topic, partition, offset in placed
        if (stage := expected_stage(intake, catalog, sent)) is not None
    }
    assert len(expected) >= 2_000, f"only {len(expected)} of {len(placed)} drawn records are bad"

    def dead_letters() -> dict | None:
        _, rows = run_sql(
            settings,
            "SELECT dead_letter_id, stage, reason FROM dead_letters_latest "
            f"WHERE topic LIKE '{settings.topic_prefix}.%'",
        )
        found = {row[0]: (row[1], row[2]) for row in rows}
        return found if len(expected.keys() & found.keys()) == len(expected) else None

    found = wait_for(dead_letters, 300, f"{len(expected)} dead letters", interval=2.0, explain=worker.log_tail)
    wrong = {i: (stage, found[i]) for i, stage in expected.items() if found[i][0] != stage or not found[i][1]}
    assert not wrong, list(wrong.items())[:10]

    want = {step.lid: ("OK", f"out-{step.lid}", step.reward) for step in good}

    def transitions() -> dict | None:
        _, rows = run_sql(
            settings,
            "SELECT logical_event_id, tool_status, output, reward FROM transitions_latest "
            f"WHERE session_id IN ({', '.join(repr(s) for s in SESSIONS)}) AND logical_event_id NOT LIKE 'bad-%'",
        )
        seen = {lid: (status, output, reward) for lid, status, output, reward in rows if lid in want}
        return seen if len(seen) == len(want) and all(r[2] is not None for r in seen.values()) else None

    seen = wait_for(transitions, 300, f"{len(want)} good steps", interval=2.0, explain=worker.log_tail)
    for lid, (status, output, value) in want.items():
        assert seen[lid][:2] == (status, output), (lid, seen[lid])
        assert math.isclose(seen[lid][2], value, abs_tol=1e-9), (lid, seen[lid], value)
    assert worker.proc is not None and worker.proc.poll() is None, "the worker must still run"
