"""Reward signals from a source that did not dispatch the step: an LLM judge, a metrics job, a labeller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaProducer

from streams.sdk.emitter import (
    _Emitter,
)
from streams.sdk.types import (
    DEFAULT_DELIVERY_TIMEOUT_S,
    Annotator,
    StepRef,
)
from topics.codec import AvroCodec
from topics.settings import Settings


class RewardEmitter(_Emitter):
    """Reward signals from a source that did not dispatch the step (an LLM judge, a metrics job, a labeller).

    It needs only the step's logical_event_id and session_id. `seq` is one counter across all the
    sessions this emitter writes to: strictly increasing per session, gaps allowed, no per-session state.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        source: str,
        agent_id: str | None = None,
        annotator: Annotator | str = Annotator.CODE,
        policy_version: str = "",
        producer: AIOKafkaProducer | None = None,
        producer_options: Mapping[str, Any] | None = None,
        codec: AvroCodec | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        super().__init__(
            settings,
            agent_id=agent_id or source,
            policy_version=policy_version,
            producer=producer,
            producer_options=producer_options,
            codec=codec,
            delivery_timeout_s=delivery_timeout_s,
        )
        self.source = source
        self.annotator = Annotator(annotator)

    async def reward(
        self,
        target: StepRef | str,
        value: float,
        *,
        session_id: str | None = None,
        episode_id: str | None = None,
        name: str = "reward",
        confidence: float = 1.0,
        annotator: Annotator | str | None = None,
        evidence: str | None = None,
        trace_id: str | None = None,
        attributes: Mapping[str, Any] | None = None,
        event_time: int | None = None,
        event_id: str | None = None,
    ) -> str:
        """Emit one reward for the step `target` (StepRef, or logical_event_id plus `session_id`). Returns event_id.

        `event_id`: give one derived from what was judged (e.g. a uuid5) when the same reward may be emitted again,
        by a re-run or a retry: the step assembler ignores a duplicate event_id. Default: a fresh uuid7."""
        event_id, waiting = self._reward_event(
            target, value, self.source, name, confidence, annotator or self.annotator, evidence, session_id,
            episode_id, trace_id, attributes, event_time, event_id,
        )  # fmt: skip
        if waiting is not None:
            await waiting
        return event_id


# -- synchronous facades ---------------------------------------------------------------------------
