"""Deterministic bench workloads: input events as the SDK would write them, and the Transitions they fold into.

Everything is built before a timer starts; the records are plain dicts the codec encodes (times as int micros).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from processors.steps.assembler import StepAssembler, StepState
from topics.codec import AvroCodec
from topics.ids import uuid7

DISPATCH = "treadle.events.ActionDispatched"
RESULT = "treadle.events.ToolResult"
REWARD = "treadle.events.RewardSignal"
TRANSITION = "treadle.derived.Transition"
KIND_OF = {DISPATCH: "actions", RESULT: "tool_results", REWARD: "rewards"}

BASE_TIME = 1_760_000_000_000_000  # micros
TOOLS = ("search", "fetch", "calculator", "browser")
SOURCES = ("judge", "metric", "human")


@dataclass
class Step:
    """One step's input events, in the order an agent and its reward sources would emit them."""

    session_id: str
    step: int
    logical_event_id: str
    events: list[tuple[str, dict]] = field(default_factory=list)

    @property
    def final_revision(self) -> int:
        """Distinct events folded: what the last Transition of the step must carry."""
        return len({record["envelope"]["event_id"] for _, record in self.events})


def _envelope(session: str, lid: str, seq: int, trace: str) -> dict:
    return {
        "event_id": uuid7(),
        "session_id": session,
        "agent_id": "bench-agent",
        "episode_id": f"{session}-ep0",
        "logical_event_id": lid,
        "seq": seq,
        "event_time": BASE_TIME + seq * 1000,
        "policy_version": "v1",
        "trace_id": trace,
        "attributes": {"bench": "1"},
    }


def make_steps(events: int, sessions: int, seed: int = 7, rewards: tuple[int, int] = (1, 3)) -> list[Step]:
    """Steps of dispatch + tool result + `rewards` (1-3) rewards over `sessions` sessions, until >= `events` events.

    Returned in the order they are sent: step k of every session, then step k+1, so sessions interleave.
    """
    rng = random.Random(seed)
    names = [f"bench-{s:05d}-{uuid7()[-12:]}" for s in range(sessions)]
    seqs = dict.fromkeys(names, 0)
    steps: list[Step] = []
    total = 0
    k = 0
    while total < events:
        for session in names:
            if total >= events:
                break
            lid = uuid7()
            trace = lid.replace("-", "")
            step = Step(session, k, lid)

            def env(session: str = session, lid: str = lid, trace: str = trace) -> dict:
                seqs[session] += 1
                return _envelope(session, lid, seqs[session], trace)

            tool = rng.choice(TOOLS)
            step.events.append((DISPATCH, dispatch_record(rng, env(), k, tool)))
            step.events.append((RESULT, result_record(rng, env(), tool)))
            for source in rng.sample(SOURCES, rng.randint(*rewards)):
                step.events.append((REWARD, reward_record(rng, env(), source)))
            steps.append(step)
            total += len(step.events)
        k += 1
    return steps


def dispatch_record(rng: random.Random, envelope: dict, step: int, tool: str) -> dict:
    return {
        "envelope": envelope,
        "step": step,
        "tool": tool,
        "params_json": f'{{"q": "query {rng.randrange(10_000)}", "limit": {rng.randint(1, 50)}}}',
        "deadline": None,
    }


def result_record(rng: random.Random, envelope: dict, tool: str) -> dict:
    status = rng.choice(("OK", "OK", "OK", "ERROR", "TIMEOUT"))
    return {
        "envelope": envelope,
        "tool": tool,
        "status": status,
        "output": f"result text {rng.randrange(1_000_000)} " * 4,
        "error": None if status == "OK" else "upstream failed",
        "latency_ms": round(rng.uniform(5, 900), 3),
        "cost_usd": round(rng.uniform(0, 0.02), 5),
        "tokens_in": rng.randint(10, 2000),
        "tokens_out": rng.randint(10, 800),
        "retries": 0,
    }


def reward_record(rng: random.Random, envelope: dict, source: str) -> dict:
    return {
        "envelope": envelope,
        "source": source,
        "name": "quality",
        "value": round(rng.uniform(-1, 1), 4),
        "confidence": round(rng.uniform(0.1, 1.0), 3),
        "annotator": "LLM" if source == "judge" else ("HUMAN" if source == "human" else "CODE"),
        "evidence": None,
    }


def encoded_events(steps: list[Step], codec: AvroCodec) -> list[tuple[str, bytes, bytes]]:
    """(topic kind, key, value) of every event, in send order, Avro single-object encoded."""
    out = []
    for step in steps:
        key = step.session_id.encode()
        for schema, record in step.events:
            out.append((KIND_OF[schema], key, codec.encode(schema, record)))
    return out


def final_transitions(steps: list[Step], codec: AvroCodec) -> list[dict]:
    """The final-revision Transition of every step, as the sink receives it (folded, encoded, decoded)."""
    assembler = StepAssembler()
    out = []
    for step in steps:
        state = StepState(step.logical_event_id)
        records: list = []
        for schema, record in step.events:
            assembler.fold(state, schema, record)
            records = assembler.outputs(state)
        transition = next(r for name, r in records if name == TRANSITION)
        out.append(codec.decode(codec.encode(TRANSITION, transition), expect=TRANSITION)[1])
    return out


# --- the reward-weaving workload (issue #3) ----------------------------------------------------------------------
# Every step: dispatch, tool result, one reward from each of 3 required sources; 10% of rewards late (sent after
# their source's window + grace, with their real time as event_time); 5% of events sent twice (same bytes).

WEAVING_POLICY_VERSION = "bench-weaving-v1"
WINDOWS = {"judge": (1.0, 0.5), "metric": (2.0, 0.5), "human": (3.0, 1.0)}  # source -> (window_s, grace_s)
LATE_SHARE = 0.10
DUPLICATE_SHARE = 0.05
EVENTS_PER_STEP = (2 + len(WINDOWS)) * (1 + DUPLICATE_SHARE)  # input events per step, duplicates included


def weaving_policy() -> dict:
    """The reward policy file the worker gets (TREADLE_REWARD_POLICY): every source required."""
    specs = [
        {"source": s, "window_s": w, "grace_s": g, "required": True, "weight": 1.0} for s, (w, g) in WINDOWS.items()
    ]
    # Sources without a spec would get a day's window by default, and a step's state is kept until its latest
    # possible deadline (of any source) plus TREADLE_STEP_RETENTION_S: short defaults let steps expire in a soak.
    longest_window, longest_grace = max(WINDOWS.values())
    return {
        "version": WEAVING_POLICY_VERSION,
        "specs": specs,
        "default_window_s": longest_window,
        "default_grace_s": longest_grace,
    }


@dataclass(eq=False)
class Planned:
    """One send: `at_s` seconds after the start; event_time and seq are set when it is encoded (`encode`)."""

    at_s: float
    schema: str
    record: dict
    original: Planned | None = None  # a duplicate re-sends the original's bytes
    encoded: bytes | None = None

    @property
    def session_id(self) -> str:
        return self.record["envelope"]["session_id"]

    def encode(self, codec: AvroCodec, event_time_us: int, seqs: dict[str, int]) -> bytes:
        """The bytes to send; an original gets its event_time and the session's next seq first."""
        if self.original is not None:
            assert self.original.encoded is not None, "a duplicate is sent after its original"
            return self.original.encoded
        env = self.record["envelope"]
        seqs[env["session_id"]] = env["seq"] = seqs.get(env["session_id"], 0) + 1
        env["event_time"] = event_time_us
        self.encoded = codec.encode(self.schema, self.record)
        return self.encoded


def weaving_plan(
    rate: float, *, sessions: int, seed: int, events: int | None = None, duration_s: float | None = None
) -> Iterator[Planned]:
    """The workload at `rate` input events/s, in send order, until `events` planned or `duration_s` of dispatches.

    A generator (a soak plans millions of events): steps are made as their dispatch time comes, and their later
    events wait in a heap until it is their turn.
    """
    rng = random.Random(seed)
    names = [f"weave-{s:05d}-{uuid7()[-12:]}" for s in range(sessions)]
    step_interval = EVENTS_PER_STEP / rate
    heap: list[tuple[float, int, Planned]] = []
    order = itertools.count()
    planned = k = 0
    while True:
        dispatch_at = k * step_interval
        more = (events is None or planned < events) and (duration_s is None or dispatch_at < duration_s)
        while heap and (not more or heap[0][0] <= dispatch_at):
            yield heapq.heappop(heap)[2]
        if not more:
            return
        for item in _weaving_step(rng, names[k % sessions], k // sessions, dispatch_at):
            heapq.heappush(heap, (item.at_s, next(order), item))
            planned += 1
        k += 1


def _unsent_envelope(session: str, lid: str) -> dict:
    """A step's envelope with a fresh event_id; seq and event_time are set when it is sent (Planned.encode)."""
    return _envelope(session, lid, 0, lid.replace("-", ""))


def _weaving_step(rng: random.Random, session: str, k: int, at: float) -> list[Planned]:
    lid = uuid7()

    def env() -> dict:
        return _unsent_envelope(session, lid)

    tool = rng.choice(TOOLS)
    items = [
        Planned(at, DISPATCH, dispatch_record(rng, env(), k, tool)),
        Planned(at + rng.uniform(0.05, 0.4), RESULT, result_record(rng, env(), tool)),
    ]
    for source, (window, grace) in WINDOWS.items():
        # A late reward is sent after its deadline, so its real time is late; one in time is sent inside its
        # window, and the grace is the margin for a producer running behind.
        late = rng.random() < LATE_SHARE
        offset = window + grace + rng.uniform(0.3, 1.5) if late else rng.uniform(0.1, window)
        items.append(Planned(at + offset, REWARD, reward_record(rng, env(), source)))
    duplicates = [
        Planned(item.at_s + rng.uniform(0.1, 1.0), item.schema, item.record, original=item)
        for item in items
        if rng.random() < DUPLICATE_SHARE
    ]
    return items + duplicates


@dataclass
class StepExpectation:
    """What one step's rows must say, from the events as sent (computed here, not by the worker's code)."""

    dispatched_us: int | None = None
    results: list[int] = field(default_factory=list)  # event times
    rewards: dict[str, tuple[str, int]] = field(default_factory=dict)  # event_id -> (source, event_time)

    def is_late(self, source: str, event_time_us: int) -> bool:
        assert self.dispatched_us is not None
        window, grace = WINDOWS[source]
        return event_time_us > self.dispatched_us + round((window + grace) * 1_000_000)

    @property
    def late(self) -> set[str]:
        return {eid for eid, (src, t) in self.rewards.items() if self.is_late(src, t)}

    @property
    def on_time(self) -> list[tuple[str, int]]:
        return [(src, t) for src, t in self.rewards.values() if not self.is_late(src, t)]

    @property
    def final_revision(self) -> int:
        """Dispatch + results + rewards in time + every required window passed (processors/steps/assembler.py)."""
        return 1 + len(self.results) + len(self.on_time) + len(WINDOWS)

    @property
    def complete(self) -> bool:
        """Every required source has a reward in time: the step gets a `complete` row as the last one arrives."""
        return {src for src, _ in self.on_time} == set(WINDOWS)

    @property
    def last_reward_us(self) -> int:
        """The event time of the step's last required reward (its complete row's updated_at, or before it)."""
        return max(t for _, t in self.on_time)


class WeavingExpectation:
    """Per step, the expectation, fed with every original as it is sent (duplicates change nothing)."""

    def __init__(self) -> None:
        self.steps: dict[str, StepExpectation] = {}

    def sent(self, item: Planned) -> None:
        if item.original is not None:
            return
        env = item.record["envelope"]
        step = self.steps.setdefault(env["logical_event_id"], StepExpectation())
        if item.schema == DISPATCH:
            step.dispatched_us = env["event_time"]
        elif item.schema == RESULT:
            step.results.append(env["event_time"])
        else:
            step.rewards[env["event_id"]] = (item.record["source"], env["event_time"])

    @classmethod
    def union(cls, *parts: WeavingExpectation) -> WeavingExpectation:
        """The steps of several runs (their ids are distinct), to check them all at once."""
        whole = cls()
        for part in parts:
            whole.steps.update(part.steps)
        return whole

    def final_revisions(self) -> dict[str, int]:
        return {lid: step.final_revision for lid, step in self.steps.items()}

    def late(self) -> set[str]:
        return {eid for step in self.steps.values() for eid in step.late}


def partition_keys(partitions: int, prefix: str = "sentinel") -> list[str]:
    """A session id per partition, found with Kafka's default partitioner (murmur2, as the SDK sends)."""
    from streams.sdk.batching import default_partition

    keys: dict[int, str] = {}
    n = 0
    while len(keys) < partitions:
        key = f"{prefix}-{n}"
        keys.setdefault(default_partition(key.encode(), partitions), key)
        n += 1
    return [keys[p] for p in range(partitions)]


def sentinels(partitions: int, at_s: float) -> list[Planned]:
    """Per partition, one event on each input topic the workload uses (a step of its own), `at_s` into the run.

    Sent last with an event time past every window, they move every partition's watermark (the slowest input
    topic of a partition holds it back) past every step's windows, so steps close without idle timeouts."""
    rng = random.Random(0)
    out = []
    for session in partition_keys(partitions):
        lid = uuid7()
        out += [
            Planned(at_s, DISPATCH, dispatch_record(rng, _unsent_envelope(session, lid), 0, "search")),
            Planned(at_s, RESULT, result_record(rng, _unsent_envelope(session, lid), "search")),
            Planned(at_s, REWARD, reward_record(rng, _unsent_envelope(session, lid), "judge")),
        ]
    return out
