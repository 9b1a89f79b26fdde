"""What a processor is: something that folds validated input events into state and derived records.

The worker's single Faust agent decodes and validates each input once, then hands it to every
processor that declared its schema. A processor owns its Faust tables (created in `setup`) and
publishes derived records through `Outputs`, which picks the topic from the record's schema.
"""

from __future__ import annotations

from typing import Any, Protocol

import faust

from streams.settings import Settings


class Outputs(Protocol):
    async def publish(self, schema_name: str, record: dict[str, Any], key: bytes | None) -> None: ...


class EventProcessor(Protocol):
    """`name` is unique per app (it prefixes table names); `inputs` are the schema names it takes."""

    name: str
    inputs: frozenset[str]

    def setup(self, app: faust.App, settings: Settings) -> None:
        """Create tables and timers; called once while the app is built."""
        ...

    async def process(self, schema_name: str, record: dict[str, Any], outputs: Outputs) -> None:
        """Fold one valid event; raising sends it to dead letters (stage PROCESS) and moves on."""
        ...
