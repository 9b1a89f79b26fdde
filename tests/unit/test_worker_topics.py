"""Which topics a worker makes before it starts (issue 24's rebalance hang): every table's changelog is made by
cluster preparation, as Faust would declare it, so no changelog appears mid-run and forces a second rebalance."""

from __future__ import annotations

from pathlib import Path

from processors.contracts.processor import ContractsProcessor
from processors.state.processor import StateProcessor
from processors.steps.processor import StepProcessor
from streams.runtime.app import build_pipeline
from streams.runtime.worker import changelog_specs
from topics.settings import Settings


def test_every_table_changelog_is_made_as_faust_declares_it(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, partitions=6, processors=("steps", "state", "contracts"))
    built = build_pipeline(settings, processors=[StepProcessor(), StateProcessor(), ContractsProcessor()])
    specs = {spec.name: spec for spec in changelog_specs(built.app)}
    tables = {table.changelog_topic.get_topic_name(): table for table in built.app.tables.values()}
    assert set(specs) == set(tables) and any(name.endswith("-contracts-sessions-changelog") for name in specs)
    for name, spec in specs.items():
        topic = tables[name].changelog_topic
        assert spec.partitions == 6 and spec.replication_factor == 1
        policy = {flag for flag, on in (("compact", topic.compacting), ("delete", topic.deleting)) if on}
        assert set(spec.config["cleanup.policy"].split(",")) == policy
        assert "compact" in policy
