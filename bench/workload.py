"""Deterministic bench workloads: input events as the SDK would write them, and the Transitions they fold into.

Everything is built before a timer starts; the records are plain dicts the codec encodes (times as int micros).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from processors.step_assembler import StepAssembler, StepState
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
            step.events.append(
                (
                    DISPATCH,
                    {
                        "envelope": env(),
                        "step": k,
                        "tool": tool,
                        "params_json": f'{{"q": "query {rng.randrange(10_000)}", "limit": {rng.randint(1, 50)}}}',
                        "deadline": None,
                    },
                )
            )
            status = rng.choice(("OK", "OK", "OK", "ERROR", "TIMEOUT"))
            step.events.append(
                (
                    RESULT,
                    {
                        "envelope": env(),
                        "tool": tool,
                        "status": status,
                        "output": f"result text {rng.randrange(1_000_000)} " * 4,
                        "error": None if status == "OK" else "upstream failed",
                        "latency_ms": round(rng.uniform(5, 900), 3),
                        "cost_usd": round(rng.uniform(0, 0.02), 5),
                        "tokens_in": rng.randint(10, 2000),
                        "tokens_out": rng.randint(10, 800),
                        "retries": 0,
                    },
                )
            )
            for source in rng.sample(SOURCES, rng.randint(*rewards)):
                step.events.append(
                    (
                        REWARD,
                        {
                            "envelope": env(),
                            "source": source,
                            "name": "quality",
                            "value": round(rng.uniform(-1, 1), 4),
                            "confidence": round(rng.uniform(0.1, 1.0), 3),
                            "annotator": "LLM" if source == "judge" else ("HUMAN" if source == "human" else "CODE"),
                            "evidence": None,
                        },
                    )
                )
            steps.append(step)
            total += len(step.events)
        k += 1
    return steps


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
