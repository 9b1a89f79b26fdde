"""Which topics the worker's fetch loop reads whole (ResumingConsumer._reads_whole): a record handed out past
records it never handed out sends the partition back to the first of them, instead of Faust acking them as a gap.
A CI run lost a step's contract check that way, when the contracts processor read StateVersions with an agent (now
in batches of its own: ResumingApp.read_in_batches); the state processor's flush requests still have one."""

from __future__ import annotations

from pathlib import Path

from processors.contracts.processor import ContractsProcessor
from processors.state.processor import StateProcessor
from processors.steps.processor import StepProcessor
from streams.runtime.app import build_pipeline
from streams.runtime.faust_transport import ResumingConsumer
from topics.catalog import TopicCatalog
from topics.settings import Settings


async def test_inputs_and_agent_topics_are_read_whole_but_not_changelogs_or_compacted_topics(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, partitions=3, processors=("steps", "state", "contracts"))
    app = build_pipeline(settings, processors=[StepProcessor(), StateProcessor(), ContractsProcessor()]).app
    compacted = app.topic(f"{settings.topic_prefix}-registry", compacting=True, value_serializer="raw")
    foreign = app.topic("another-systems-events", value_serializer="raw")  # maybe written with transactions
    registry = TopicCatalog(settings)["contracts"]  # a catalog topic, but compacted

    for n, topic in enumerate((compacted, foreign, app.topic(registry.name, value_serializer="raw"))):

        @app.agent(topic, name=f"plugin-reader-{n}")
        async def read(stream):  # type: ignore[no-untyped-def]
            async for _ in stream:
                pass

    for agent in app.agents.values():
        aiter(agent.channel)  # what an agent's start does: its topic joins the conductor's
    for table in app.tables.values():
        app.topics.add(table.changelog_topic)  # what the table manager's start does
    consumer = app.consumer
    assert isinstance(consumer, ResumingConsumer)
    catalog = TopicCatalog(settings)
    inputs = sorted(app.batch_topics)
    assert inputs and all(consumer._reads_whole(name) for name in inputs)
    assert consumer._reads_whole(catalog["state_versions"].name)  # the contracts processor's (read_in_batches)
    assert consumer._reads_whole(f"{settings.app_id}-state-ticks")  # the state processor's flush requests
    changelogs = {table.changelog_topic.get_topic_name() for table in app.tables.values()}
    assert changelogs and not any(consumer._reads_whole(name) for name in changelogs)
    assert not consumer._reads_whole(f"{settings.topic_prefix}-registry")
    assert not consumer._reads_whole("another-systems-events")  # its holes may be commit markers: Faust's way
    assert not consumer._reads_whole(registry.name)
    assert not consumer._reads_whole("a-topic-nobody-here-reads")
