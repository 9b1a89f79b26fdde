"""Background-merge settings for the tables the sink writes all the time.

The sink inserts every table's batch every TREADLE_SINK_FLUSH_SECONDS, so these tables get a new small part per
flush, and ClickHouse merges them in the background (ReplacingMergeTree needs the merges to collapse revisions).
On chDB 4.4 (ClickHouse 26.9) `merge_selector_enable_heuristic_to_lower_max_parts_to_merge_at_once` is on: merges
take fewer parts at once, so each row is rewritten more often. Turning it off and raising `merge_selector_base`
from 5 to 10 (ClickHouse: "affects write amplification") took the weaving bench's sink from 11% to 7.6% of a core
in merge threads at 5,000 events/s, on the core it shares with Kafka. The cost is a few more parts at a time
between merges, which the `*_latest` views (FINAL) read. On a server, only the settings it knows are set, so an
older one that lacks one is left as it is; `ALTER TABLE ... RESET SETTING ...` undoes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sinks.clickhouse import ClickHouseStore

log = logging.getLogger(__name__)

BUSY_TABLES = ("raw_events", "reward_components", "transitions", "woven_rewards", "late_rewards")
MERGE_SETTINGS: Mapping[str, int] = {
    "merge_selector_enable_heuristic_to_lower_max_parts_to_merge_at_once": 0,
    "merge_selector_base": 10,
}


def apply_merge_settings(store: ClickHouseStore, settings: Mapping[str, int] = MERGE_SETTINGS) -> dict[str, int]:
    """Set `settings` on BUSY_TABLES, those the server knows; returns what was set (re-running changes nothing)."""
    known = {name for (name,) in store.query_sync("SELECT name FROM system.merge_tree_settings").result_rows}
    chosen = {name: value for name, value in settings.items() if name in known}
    skipped = sorted(set(settings) - known)
    if skipped:
        log.info("this ClickHouse has no MergeTree setting %s: left as it is", ", ".join(skipped))
    if chosen:
        clause = ", ".join(f"{name} = {int(value)}" for name, value in chosen.items())
        for table in BUSY_TABLES:
            store.command_sync(f"ALTER TABLE {store.database}.{table} MODIFY SETTING {clause}")
    return chosen
