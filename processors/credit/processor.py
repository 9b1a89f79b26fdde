"""Credit assignment as a Faust processor: an EpisodeState per (session_id, episode_id) in a RocksDB table.

The credit signals it publishes go to the rewards topic, so the step assembler folds each into its step as a
reward component (source "credit"); see processors/credit/rules.py for the rules and when an episode is credited.
All events of a session share a partition, so an episode's state lives in that partition's table shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import faust

from processors.credit.rules import CREDIT_INPUTS, CreditRule, EpisodeCredit, EpisodeState, RuleChoice, episode_key
from processors.credit.rules import episode_of as _episode_of
from streams.runtime import table_writes
from streams.runtime.processor import InputEvent, ProcessingContext
from streams.runtime.value_limits import ValueBudget, refuse, too_large
from topics.names import REWARD
from topics.settings import Settings


@dataclass
class _Touched:
    state: EpisodeState
    event: InputEvent  # any event of the episode: all share its session's partition
    budget: ValueBudget  # the state's size, known exactly only near the limit (TREADLE_MAX_EVENT_BYTES)
    changed: bool = False
    emit: set[str] = field(default_factory=set)


class CreditProcessor:
    """Spreads episode rewards (scope=episode signals, EPISODE_ENDED rewards) over the episode's steps."""

    name = "credit"
    kind = "reward_source"
    inputs = frozenset(CREDIT_INPUTS)

    def __init__(self, credit: EpisodeCredit | None = None) -> None:
        self.credit = credit
        self.table: Any = None  # faust.Table[bytes, bytes]
        self.max_state_bytes = Settings.model_fields["max_event_bytes"].default  # TREADLE_MAX_EVENT_BYTES

    def setup(self, app: faust.App, settings: Settings) -> None:
        if self.credit is None:
            self.credit = EpisodeCredit(RuleChoice(CreditRule(settings.credit_rule), settings.credit_gamma))
        self.table = table_writes.bytes_table(
            app, self.name, settings, help="EpisodeState per (session_id, episode_id), serialized with orjson."
        )
        self.max_state_bytes = settings.max_event_bytes

    async def process(self, events: list[InputEvent], ctx: ProcessingContext) -> None:
        credit = self.credit
        assert credit is not None, "setup() was not called"
        touched: dict[bytes, _Touched] = {}
        for event in events:
            episode = _episode_of(event.schema_name, event.record)
            if episode is None:
                continue  # step-level rewards (our own output included) and other lifecycle phases
            key = episode_key(*episode)
            entry = touched.get(key)
            try:
                if entry is None:
                    ctx.bind(event)
                    stored = self.table.get(key)
                    state = EpisodeState.from_bytes(stored) if stored is not None else EpisodeState(*episode)
                    budget = ValueBudget(self.max_state_bytes, len(stored) if stored is not None else 0)
                    entry = touched[key] = _Touched(state, event, budget)
                event_bytes = len(event.source.value or b"")
                if not entry.budget.near(event_bytes):
                    folded = credit.fold(entry.state, event.schema_name, event.record)
                    entry.budget.grew(event_bytes)
                else:  # measure: an episode whose state would pass the limit refuses the event, as a step does
                    before = entry.state.to_bytes()
                    folded = credit.fold(entry.state, event.schema_name, event.record)
                    size = len(entry.state.to_bytes())
                    if size > self.max_state_bytes:
                        entry.state = EpisodeState.from_bytes(before)
                        what = f"episode {episode[1]!r} of session {episode[0]!r}"
                        await refuse(ctx, self.name, event, too_large(self.name, what, size, self.max_state_bytes))
                        continue
                    entry.budget.measured(size)
                entry.changed |= folded.changed
                entry.emit.update(folded.emit)
            except Exception as exc:  # an invalid credit_rule/gamma, corrupt state or a bug: dead-letter, go on
                await ctx.failed(self.name, event, exc)
        for key, entry in touched.items():
            if entry.changed:
                await table_writes.put(self.table, key, entry.state.to_bytes(), entry.event, ctx)
            for reward_key in sorted(entry.emit):
                for record in credit.records(entry.state, reward_key):
                    await ctx.publish(REWARD, record, key=entry.event.session_key)
