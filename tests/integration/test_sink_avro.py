"""Records the sink keeps as bytes land as the rows the sink's Python mappers make, on both byte paths.

Each AVRO_TABLES kind is generated from its Avro schema (hypothesis), encoded as the worker encodes it, and inserted
twice into chDB: decoded and mapped in Python (ClickHouseSink.add), and as bytes (ClickHouseSink.add_encoded), which
treadle_native turns into a Native block (NativeBlocks; `native`) or, with TREADLE_NATIVE=0, ClickHouse reads as an
Avro container (`avro`). Both copies must hold the same rows, value for value.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import fastavro
import pytest
from aiokafka.structs import ConsumerRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sinks import migrations
from sinks.avro_container import AvroContainer
from sinks.clickhouse import ClickHouseStore
from sinks.native_blocks import NativeBlocks
from sinks.rows import AVRO_TABLES, TABLE_COLUMNS
from sinks.writer import ClickHouseSink
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec, DecodeError
from topics.settings import Settings

CODEC = AvroCodec()
SCHEMA_OF = {kind: TopicCatalog(Settings())[kind].value_schema for kind in AVRO_TABLES}
_DATABASES = itertools.count()
MAX_MICROS = 4_102_444_800_000_000  # 2100-01-01: inside DateTime64(6)'s range
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)


def values(schema: Any) -> st.SearchStrategy[Any]:
    """Values of an Avro schema in the domain the worker writes: finite floats; longs that are valid timestamps."""
    if isinstance(schema, list):
        return st.one_of([values(branch) for branch in schema])
    if isinstance(schema, str):
        schema = {"type": schema}
    kind = schema["type"]
    if isinstance(kind, dict | list):
        return values(kind)
    simple = {
        "null": st.none(),
        "boolean": st.booleans(),
        "int": st.integers(0, 2**31 - 1),
        "long": st.integers(0, MAX_MICROS),  # timestamp-micros, durations, counts
        "float": st.floats(width=32, allow_nan=False, allow_infinity=False),
        "double": st.floats(allow_nan=False, allow_infinity=False),
        "string": TEXT,
        "bytes": st.binary(max_size=12),
    }
    if kind in simple:
        return simple[kind]
    if kind == "record":
        return st.fixed_dictionaries({f["name"]: values(f["type"]) for f in schema["fields"]})
    if kind == "enum":
        return st.sampled_from(schema["symbols"])
    if kind == "array":
        return st.lists(values(schema["items"]), max_size=3)
    if kind == "map":
        return st.dictionaries(TEXT, values(schema["values"]), max_size=3)
    raise AssertionError(f"no strategy for {schema!r}")


# each table's ORDER BY: records of one batch differ in it, so no two collapse into one row (ReplacingMergeTree)
KEY_OF = {
    "transitions": ("session_id", "step", "logical_event_id"),
    "woven_rewards": ("session_id", "logical_event_id", "revision"),
    "late_rewards": ("source", "session_id", "event_id"),
}


def records(kind: str, *, min_size: int, max_size: int) -> st.SearchStrategy[list[dict[str, Any]]]:
    schema = CODEC.schemas[SCHEMA_OF[kind]]
    key = KEY_OF[kind]
    return st.lists(
        values(schema.json), min_size=min_size, max_size=max_size, unique_by=lambda r: tuple(r[k] for k in key)
    )


def encoded(kind: str) -> st.SearchStrategy[list[bytes]]:
    schema = CODEC.schemas[SCHEMA_OF[kind]]
    return records(kind, min_size=1, max_size=4).map(
        lambda records: [CODEC.encode(schema.name, record) for record in records]
    )


@pytest.fixture(scope="module")
def chdb_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = Settings(home=tmp_path_factory.mktemp("sink-avro-home"))
    with ClickHouseStore.open(settings, database="anchor"):
        yield settings


@pytest.fixture(scope="module")
def stores(chdb_settings: Settings) -> Iterator[tuple[ClickHouseStore, ClickHouseStore]]:
    """Two migrated databases: one written through Python rows, one through Avro containers."""
    opened = [ClickHouseStore.open(chdb_settings, database=f"avro{next(_DATABASES)}") for _ in range(2)]
    try:
        for store in opened:
            migrations.apply_migrations(store)
        yield opened[0], opened[1]
    finally:
        for store in opened:
            store.close()


def table_rows(store: ClickHouseStore, table: str) -> list[tuple[Any, ...]]:
    columns = ", ".join(f"`{name}`" for name in TABLE_COLUMNS[table])
    return sorted(store.query_sync(f"SELECT {columns} FROM {table}").result_rows, key=repr)


@pytest.fixture(params=["native", "avro"])
def byte_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How add_encoded's bytes reach ClickHouse: Native blocks made by treadle_native, or Avro (TREADLE_NATIVE=0)."""
    if request.param == "avro":
        monkeypatch.setenv("TREADLE_NATIVE", "0")
    else:
        monkeypatch.delenv("TREADLE_NATIVE", raising=False)
        assert NativeBlocks.built(), "treadle_native with NativeBlockWriter is not built: `make install`"
    return str(request.param)


def through_both_paths(
    stores: tuple[ClickHouseStore, ClickHouseStore], kind: str, batch: list[bytes], native: bool
) -> None:
    by_rows, by_avro = stores
    table = AVRO_TABLES[kind]
    for store in stores:
        store.command_sync(f"TRUNCATE TABLE {table}")
    python_sink, avro_sink = ClickHouseSink(by_rows), ClickHouseSink(by_avro, native_blocks=native)
    for value in batch:
        python_sink.add(kind, CODEC.decode(value, expect=SCHEMA_OF[kind])[1])
        avro_sink.add_encoded(kind, value, expect=SCHEMA_OF[kind])
    assert avro_sink._batches == {}, "records of the current schema are not decoded in Python"
    assert asyncio.run(python_sink.flush()) == asyncio.run(avro_sink.flush()) == {table: len(batch)}
    assert avro_sink._batches == {}, "no record was refused and decoded in Python"
    writers = list(avro_sink._native._writers.values())
    assert writers == [None] if not native else writers and None not in writers
    assert table_rows(by_avro, table) == table_rows(by_rows, table)


@pytest.mark.parametrize("kind", sorted(AVRO_TABLES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_bytes_land_as_the_python_mapper_maps_them(
    stores: tuple[ClickHouseStore, ClickHouseStore], byte_path: str, kind: str, data: st.DataObject
) -> None:
    through_both_paths(stores, kind, data.draw(encoded(kind)), byte_path == "native")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=values(CODEC.schemas[SCHEMA_OF["transitions"]].json))
def test_more_distinct_strings_than_a_byte_indexes(
    stores: tuple[ClickHouseStore, ClickHouseStore], byte_path: str, record: dict[str, Any]
) -> None:
    """300 agents in a LowCardinality column: the Native block's dictionary needs 2-byte indexes."""
    batch = [{**record, "session_id": f"s{i}", "agent_id": f"agent-{i}"} for i in range(300)]
    values = [CODEC.encode(SCHEMA_OF["transitions"], r) for r in batch]
    through_both_paths(stores, "transitions", values, byte_path == "native")


LATE = CODEC.schemas[SCHEMA_OF["late_rewards"]]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(late=records("late_rewards", min_size=3, max_size=3))
def test_a_record_that_cannot_be_read_is_decoded_in_python_and_only_it_is_lost(
    stores: tuple[ClickHouseStore, ClickHouseStore],
    byte_path: str,
    caplog: pytest.LogCaptureFixture,
    late: list[dict[str, Any]],
) -> None:
    _, store = stores
    store.command_sync("TRUNCATE TABLE late_rewards")
    good = [CODEC.encode(LATE.name, record) for record in late]
    truncated = good[0][:-4]
    sink = ClickHouseSink(store, native_blocks=byte_path == "native")
    for value in (good[0], truncated, good[1], good[2]):
        sink.add_encoded("late_rewards", value, expect=LATE.name)
    assert sink.pending_rows == {"late_rewards": 4}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(sink.flush()) == {"late_rewards": 3}
    assert sink.undecodable == 1 and sink.pending == 0
    if byte_path == "native":  # treadle_native refuses the batch: it goes the Python way
        assert "treadle_native refused a batch of 4 records for late_rewards" in caplog.text
    else:
        assert "ClickHouse could not insert 4 Avro records into late_rewards" in caplog.text
    assert "undecodable treadle.derived.LateReward record bound for late_rewards" in caplog.text
    assert store.query_sync("SELECT count() FROM late_rewards").result_rows == [(3,)]


def fetched(values: list[bytes | None], partition: int = 2) -> list[ConsumerRecord]:
    """The values as a fetch hands them to the sink's consumer."""
    return [
        ConsumerRecord("t", partition, 100 + i, 1_700_000_000_000 + i, 0, None, v, None, -1, len(v or b""), ())
        for i, v in enumerate(values)
    ]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(late=records("late_rewards", min_size=3, max_size=3))
def test_a_fetch_is_taken_whole_and_a_bad_record_in_it_is_rejected_with_its_offset(
    stores: tuple[ClickHouseStore, ClickHouseStore], byte_path: str, late: list[dict[str, Any]]
) -> None:
    """add_encoded_records keeps the ConsumerRecords as their rows' sources: the one record the batch cannot insert
    becomes a rejected_rows row naming its topic, partition and offset, and the others land."""
    _, store = stores
    for table in ("late_rewards", "rejected_rows"):
        store.command_sync(f"TRUNCATE TABLE {table}")
    good = [CODEC.encode(LATE.name, record) for record in late]
    sink = ClickHouseSink(store, batch_size=4, native_blocks=byte_path == "native")
    assert sink.add_encoded_records("late_rewards", fetched([good[0], good[0][:-4]]), LATE.name) is False
    assert sink.add_encoded_records("late_rewards", fetched(good[1:], partition=3), LATE.name) is True
    assert sink._batches == {} and sink.pending_rows == {"late_rewards": 4}
    assert asyncio.run(sink.flush()) == {"late_rewards": 3, "rejected_rows": 1}
    assert store.query_sync("SELECT count() FROM late_rewards").result_rows == [(3,)]
    rejected = store.query_sync("SELECT rejected_id, stage, target_table, value FROM rejected_rows").result_rows
    assert rejected == [("t/2/101", "MAP", "late_rewards", good[0][:-4].hex())]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=values(LATE.json))
def test_a_fetch_that_cannot_stay_bytes_is_left_to_the_one_by_one_way(
    stores: tuple[ClickHouseStore, ClickHouseStore], record: dict[str, Any]
) -> None:
    late = CODEC.encode(LATE.name, record)
    sink = ClickHouseSink(stores[1])
    unknown = b"\xc3\x01" + bytes(8) + b"\x00"  # another writer schema
    letter = "treadle.derived.DeadLetter"
    assert sink.add_encoded_records("late_rewards", fetched([late, None]), LATE.name) is None  # a tombstone
    assert sink.add_encoded_records("late_rewards", fetched([late, unknown]), LATE.name) is None
    assert sink.add_encoded_records("late_rewards", [], LATE.name) is None
    assert sink.add_encoded_records("dead_letters", fetched([late]), letter) is None  # not a bytes table
    assert sink.pending == 0, "nothing was buffered by a refused fetch"
    assert sink.add_encoded_records("late_rewards", fetched([late]), LATE.name) is False
    assert sink.pending_rows == {"late_rewards": 1}


TRANSITION = CODEC.schemas[SCHEMA_OF["transitions"]]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=records("transitions", min_size=2, max_size=4), revision=st.sampled_from([-1, -(2**31), 2**31 - 1]))
def test_a_value_its_column_does_not_take_is_left_to_the_python_way(
    stores: tuple[ClickHouseStore, ClickHouseStore],
    batch: list[dict[str, Any]],
    revision: int,
) -> None:
    """revision is an Avro int in a UInt32 column: the native writer refuses a negative one, and the batch then lands
    exactly as the Python mapper and clickhouse-connect make it (which is what the sink did before NativeBlocks)."""
    assert NativeBlocks.built(), "treadle_native with NativeBlockWriter is not built: `make install`"
    batch[0]["revision"] = revision
    values = [CODEC.encode(TRANSITION.name, record) for record in batch]
    by_rows, by_native = stores
    outcomes = []
    for store, add in ((by_rows, "add"), (by_native, "add_encoded")):
        store.command_sync("TRUNCATE TABLE transitions")
        sink = ClickHouseSink(store, native_blocks=True)
        for value in values:
            if add == "add":
                sink.add("transitions", CODEC.decode(value, expect=TRANSITION.name)[1])
            else:
                sink.add_encoded("transitions", value, expect=TRANSITION.name)
        try:
            outcomes.append(asyncio.run(sink.flush()))
        except Exception as exc:  # what clickhouse-connect says of a negative UInt32, the same on both paths
            outcomes.append(type(exc).__name__)
        outcomes.append(table_rows(store, "transitions"))
    assert outcomes[0:2] == outcomes[2:4]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=values(CODEC.schemas["treadle.derived.DeadLetter"].json))
def test_other_writer_schemas_and_kinds_take_the_python_path(
    stores: tuple[ClickHouseStore, ClickHouseStore], record: dict[str, Any]
) -> None:
    sink, letter = ClickHouseSink(stores[1]), "treadle.derived.DeadLetter"
    sink.add_encoded("dead_letters", CODEC.encode(letter, record), expect=letter)
    assert set(sink._batches) == {"dead_letters"} and sink._containers == {}
    unknown = b"\xc3\x01" + bytes(8) + b"\x00"  # a fingerprint no schema has: not passed through to ClickHouse
    with pytest.raises(DecodeError, match="unknown writer schema fingerprint"):
        sink.add_encoded("transitions", unknown, expect=SCHEMA_OF["transitions"])
    with pytest.raises(DecodeError, match="tombstone"):
        sink.add_encoded("transitions", None, expect=SCHEMA_OF["transitions"])


@given(late=st.lists(values(LATE.json), max_size=4))
def test_a_container_is_an_avro_file_any_reader_reads(late: list[dict[str, Any]]) -> None:
    container = AvroContainer(LATE)
    for record in late:
        container.append(CODEC.encode(LATE.name, record))
    assert list(fastavro.reader(io.BytesIO(container.to_bytes()))) == late and container.rows == len(late)
