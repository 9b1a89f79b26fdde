"""Pure logic behind poison-pill isolation: the JSON nesting budget, output truncation, the intake never raising."""

from __future__ import annotations

import json

import pytest

from tests.factories import dispatch, result
from topics.catalog import TopicCatalog
from topics.codec import AvroCodec
from topics.intake import Accepted, Intake, Rejected, SourceMessage
from topics.json_budget import MAX_JSON_DEPTH, json_depth, json_depth_problem
from topics.output_size import DEAD_LETTER, TRANSITION, OutputTooLargeError, cut, fit, truncated
from topics.settings import Settings
from topics.tool_schemas import ToolSchemas
from topics.validation import InputValidator

CODEC = AvroCodec()
SETTINGS = Settings()
CATALOG = TopicCatalog(SETTINGS)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- JSON depth budget -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('"[[[["', 0),  # brackets inside a string do not nest
        ('{"a": [1, {"b": "]]]"}]}', 3),
        ('{"a\\"[": [[]]}', 3),  # an escaped quote does not end the string
        (nested(5_000), 5_000),
    ],
)
def test_json_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text) == depth


def test_a_document_past_the_budget_is_refused_with_the_depth_in_the_reason() -> None:
    assert json_depth_problem("params_json", nested(MAX_JSON_DEPTH)) is None
    problem = json_depth_problem("params_json", nested(MAX_JSON_DEPTH + 1))
    assert (
        problem
        == f"params_json nests deeper than 64 levels ({MAX_JSON_DEPTH + 1}); JSON fields are refused past that depth"
    )
    assert json_depth_problem("params_json", "[" * 100 + '"x"' * 3) is not None  # unbalanced still counts


def test_tool_schemas_refuse_deep_params_before_parsing_them() -> None:
    # json.loads would raise RecursionError at this depth; the budget answers first
    problem = ToolSchemas().error_in_json("search", '{"q": ' + nested(100_000) + "}")
    assert problem is not None and "nests deeper than 64 levels" in problem


# --- the intake never raises -------------------------------------------------------------------------------------


def _message(topic_kind: str, value: bytes, key: bytes = b"s1") -> SourceMessage:
    return SourceMessage(CATALOG[topic_kind].name, 0, 7, key, value, 1_700_000_000_000)


def test_intake_dead_letters_deep_params_and_oversize_events_and_never_raises() -> None:
    intake = Intake(CODEC, CATALOG, InputValidator(), max_event_bytes=12_000)
    deep = dispatch("s1", "l1", 0, 1)
    deep["params_json"] = '{"q": ' + nested(5_000) + "}"
    read = intake.read(_message("actions", CODEC.encode("treadle.events.ActionDispatched", deep)))
    assert isinstance(read, Rejected)
    assert read.dead_letter["stage"] == "VALIDATE"
    assert "nests deeper than 64 levels (5001)" in read.dead_letter["reason"]

    big = result("s1", "l1", 2)
    big["output"] = "x" * 20_000
    read = intake.read(_message("tool_results", CODEC.encode("treadle.events.ToolResult", big)))
    assert isinstance(read, Rejected) and read.dead_letter["stage"] == "VALIDATE"
    assert "above the 12,000-byte limit (TREADLE_MAX_EVENT_BYTES)" in read.dead_letter["reason"]
    assert read.dead_letter["event_id"] == big["envelope"]["event_id"]

    ok = intake.read(_message("tool_results", CODEC.encode("treadle.events.ToolResult", result("s1", "l1", 2))))
    assert isinstance(ok, Accepted)


def test_intake_turns_a_validator_crash_into_a_dead_letter() -> None:
    class Exploding(InputValidator):
        def problem(self, schema_name, record, key, encoded_bytes=None):  # type: ignore[no-untyped-def]
            raise RecursionError("maximum recursion depth exceeded")

    read = Intake(CODEC, CATALOG, Exploding()).read(
        _message("actions", CODEC.encode("treadle.events.ActionDispatched", dispatch("s1", "l1", 0, 1)))
    )
    assert isinstance(read, Rejected)
    assert read.dead_letter["stage"] == "VALIDATE"
    assert read.dead_letter["reason"].startswith("validating the record failed: RecursionError")


# --- outputs that fit --------------------------------------------------------------------------------------------


def test_cut_never_splits_a_character() -> None:
    kept, dropped = cut("aé€", 2)  # € is 3 bytes: cutting 2 takes it whole
    assert (kept, dropped) == ("aé", 3)
    assert cut(b"abcdef", 4) == (b"ab", 4)
    assert cut(b"ab", 10) == (b"", 2)


def _transition(output: str, params: str) -> dict:
    from processors.steps.assembler import StepAssembler, StepState

    assembler, state = StepAssembler(), StepState("l1")
    d = dispatch("s1", "l1", 0, 1)
    d["params_json"] = params
    r = result("s1", "l1", 2)
    r["output"] = output
    assembler.fold(state, "treadle.events.ActionDispatched", d)
    assembler.fold(state, "treadle.events.ToolResult", r)
    return assembler.transition(state, assembler.weave(state), None)


def test_a_transition_too_large_is_cut_largest_field_first_and_says_how_much() -> None:
    record = _transition("o" * 600_000, json.dumps({"q": "p" * 500_000}))
    value, dropped = fit(TRANSITION, record, CODEC.encode, 900_000, 1_040_000)
    assert len(value) <= 900_000 and dropped > 0
    _, decoded = CODEC.decode(value)
    assert decoded["truncated_bytes"] == dropped
    assert len(decoded["output"]) < 600_000 and decoded["output"] == "o" * len(decoded["output"])
    assert len(decoded["params_json"]) == len(record["params_json"])  # the largest field alone was enough


def test_a_transition_that_fits_is_untouched() -> None:
    record = _transition("ok", "{}")
    value, dropped = fit(TRANSITION, record, CODEC.encode, 900_000, 1_040_000)
    assert dropped == 0 and CODEC.decode(value)[1]["truncated_bytes"] == 0


def test_a_dead_letter_of_an_oversize_input_keeps_a_cut_value() -> None:
    from topics.dead_letters import dead_letter

    letter = dead_letter(
        "VALIDATE", "too large", topic="t", partition=0, offset=1, key=b"k", value=b"v" * 1_000_000, timestamp_ms=1
    )
    value, dropped = fit(DEAD_LETTER, letter, CODEC.encode, 900_000, 1_040_000)
    decoded = CODEC.decode(value)[1]
    assert len(value) <= 900_000
    assert decoded["value_truncated_bytes"] == dropped == 1_000_000 - len(decoded["value"])


def test_an_uncuttable_output_passes_up_to_the_hard_limit_then_raises() -> None:
    metric = {"x": 1}
    assert truncated("treadle.derived.EvaluationMetric", metric, 10) is None

    def encode(schema: str, record: dict) -> bytes:
        return b"z" * record["size"]

    assert fit("treadle.derived.EvaluationMetric", {"size": 950}, encode, 900, 1_000) == (b"z" * 950, 0)
    with pytest.raises(OutputTooLargeError, match="1,001 bytes encoded, above the 900-byte limit"):
        fit("treadle.derived.EvaluationMetric", {"size": 1_001}, encode, 900, 1_000)


def test_dead_letter_reasons_are_bounded() -> None:
    from topics.dead_letters import MAX_REASON_CHARS, dead_letter

    letter = dead_letter("PROCESS", "r" * 100_000, topic="t", partition=0, offset=1, key=None, value=None,
                         timestamp_ms=1)  # fmt: skip
    assert len(letter["reason"]) < MAX_REASON_CHARS + 20


def test_a_dead_letter_with_a_huge_key_still_fits() -> None:
    from topics.dead_letters import dead_letter

    letter = dead_letter(
        "VALIDATE", "r", topic="t", partition=0, offset=1, key=b"k" * 700_000, value=b"v" * 700_000, timestamp_ms=1
    )
    assert len(letter["session_id"]) == 1_024  # taken from the key, bounded
    value, dropped = fit(DEAD_LETTER, letter, CODEC.encode, 900_000, 1_040_000)
    decoded = CODEC.decode(value)[1]
    assert len(value) <= 900_000
    assert dropped == 1_400_000 - len(decoded["value"]) - len(decoded["key"])


def test_ids_longer_than_the_limit_are_refused() -> None:
    record = dispatch("s" * 2_000, "l1", 0, 1)
    problem = InputValidator().problem("treadle.events.ActionDispatched", record, b"s" * 2_000)
    assert problem == "envelope.session_id is 2,000 characters long; ids are limited to 1,024"


def test_the_sdk_refuses_an_overlong_id_as_the_worker_would() -> None:
    from streams.sdk import AgentStream

    record = result("s1", "l1", 2)
    record["envelope"]["agent_id"] = "a" * 2_000
    stream = AgentStream(SETTINGS, agent_id="agent")
    with pytest.raises(ValueError, match=r"envelope\.agent_id is 2,000 characters long; ids are limited to 1,024"):
        stream._encode("treadle.events.ToolResult", record)
