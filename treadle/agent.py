"""The SDK as users import it: producing (the streaming runtime's emitters) plus reading a session's state.

Reads need what the base install does not have (Redis for the latest state, ClickHouse for history), and they sit
above the processors and sinks that write that state, so they are added here rather than in the emitters.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import ClassVar

from processors.state.model import StateGraph
from streams.sdk import AgentStream as _ProducingStream
from streams.sdk import AgentStreamSync as _ProducingStreamSync
from streams.sdk.emitter import _Emitter
from streams.sdk.sync import blocking


class AgentStream(_ProducingStream):
    __doc__ = _ProducingStream.__doc__

    async def state(self) -> StateGraph | None:
        """The session's latest state graph from Redis, expired nodes removed; None before its first version.

        The state processor writes Redis after each commit, so this is O(1) and a little behind the events
        just emitted (a state event waits for its seq's turn in the state graph's fold).
        """
        from processors.state.cache import StateCache, connect  # needs redis: not in the base install

        client = connect(self.settings)
        try:
            return await StateCache(client, self.settings.topic_prefix).read(self.session_id)
        finally:
            await client.aclose()

    async def state_at(self, version_or_time: str | int | datetime) -> StateGraph:
        """The session's graph at a version id, ordinal or time, from the ClickHouse history tables."""
        from treadle.state.history import state_at  # needs ClickHouse: not in the base install

        return await asyncio.to_thread(state_at, self.settings, self.session_id, version_or_time)

    async def available_actions(self, at: str | int | datetime | None = None) -> list[str]:
        """The action mask: the tools whose contracts' preconditions hold in the session's state at a version id,
        ordinal or time (default: now), with the contracts effective then (docs/contracts.md)."""
        from treadle.contracts_command import mask, registry  # needs ClickHouse and the CEL engine

        graph = await self.state_at(at if at is not None else datetime.now(UTC))
        return mask(await registry(self.settings).load(), graph)


class AgentStreamSync(_ProducingStreamSync):
    __doc__ = _ProducingStreamSync.__doc__

    emitter_class: ClassVar[type[_Emitter]] = AgentStream
    state = blocking(AgentStream.state)
    state_at = blocking(AgentStream.state_at)
    available_actions = blocking(AgentStream.available_actions)
