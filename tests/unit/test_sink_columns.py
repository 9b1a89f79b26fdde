"""The sink's columnar buffering (pure logic): reward components as Nested sub-columns, rows as tuples transposed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sinks.rows import _components, micros
from sinks.writer import _TableBatch

component = st.fixed_dictionaries(
    {
        "event_id": st.uuids().map(str),
        "source": st.sampled_from(["judge", "metric", "human"]),
        "name": st.text(max_size=5),
        "value": st.floats(-10, 10) | st.integers(-5, 5),
        "confidence": st.floats(0, 1),
        "annotator": st.sampled_from(["CODE", "HUMAN", "MODEL"]),
        "event_time": st.integers(0, 2**52),
    },
    optional={
        "weight": st.floats(0, 2),
        "contribution": st.floats(-1, 1),
        "adjusted_value": st.none() | st.floats(-1, 1),
        "lateness_ms": st.integers(0, 10**6),
        "evidence": st.none() | st.text(max_size=5),
        "imputed": st.booleans(),
    },
)


def field_by_field(prefix: str, components: list[dict]) -> dict:
    """The mapping spelled out one field at a time: what `_components` must equal."""
    adjusted = [c.get("adjusted_value") for c in components]
    return {
        f"{prefix}.event_id": [str(c["event_id"]) for c in components],
        f"{prefix}.source": [c["source"] for c in components],
        f"{prefix}.name": [c["name"] for c in components],
        f"{prefix}.value": [float(c["value"]) for c in components],
        f"{prefix}.confidence": [float(c["confidence"]) for c in components],
        f"{prefix}.weight": [float(c.get("weight", 1.0)) for c in components],
        f"{prefix}.annotator": [str(c["annotator"]) for c in components],
        f"{prefix}.event_time": [micros(c["event_time"]) for c in components],
        f"{prefix}.contribution": [float(c.get("contribution", 0.0)) for c in components],
        f"{prefix}.adjusted_value": [None if a is None else float(a) for a in adjusted],
        f"{prefix}.lateness_ms": [int(c.get("lateness_ms", 0)) for c in components],
        f"{prefix}.evidence": [c.get("evidence") for c in components],
        f"{prefix}.imputed": [bool(c.get("imputed", False)) for c in components],
    }


@given(st.sampled_from(["reward_components", "components"]), st.lists(component, max_size=6))
def test_components_are_one_list_per_field_aligned_by_index(prefix, components):
    made = _components(prefix, components)
    expected = field_by_field(prefix, components)
    assert list(made) == list(expected)
    assert made == expected
    assert all(type(column) is list for column in made.values())


NAMES = ("a", "b", "c")
rows = st.lists(st.tuples(st.integers(), st.text(max_size=3), st.none() | st.floats(allow_nan=False)), max_size=30)


@given(rows, rows, st.data())
def test_a_batch_holds_its_rows_as_columns_failed_rows_first(earlier, later, data):
    failed, batch = _TableBatch(NAMES), _TableBatch(NAMES)
    for row in earlier:
        failed.append(dict(zip(NAMES, row, strict=True)), source=None)
    for row in later:
        batch.append_values(row)
    batch.extend_front(failed)  # a flush that failed puts its rows back ahead of the newer ones
    everything = earlier + later
    assert batch.rows == len(everything)
    assert batch.columns == [[row[i] for row in everything] for i in range(len(NAMES))]
    indexes = data.draw(st.lists(st.integers(0, max(0, len(everything) - 1)), max_size=10)) if everything else []
    assert batch.pick(indexes) == [[everything[j][i] for j in indexes] for i in range(len(NAMES))]
