"""Fusion as data (processors/steps/fusion.py): each rule kind, the compliance example, and hypothesis properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from processors.steps.fusion import (
    Component,
    ConfidenceWeightedMean,
    FusionPolicy,
    FusionRule,
    fuse,
)


def comp(event_id: str, source: str, value: float, confidence: float = 1.0, **kw) -> Component:
    return Component(event_id=event_id, source=source, name=kw.pop("name", "reward"), value=value,
                     confidence=confidence, **kw)  # fmt: skip


COMPLIANCE = FusionRule.model_validate(
    {
        "name": "compliance_high_negative",
        "kind": "scale",
        "match": {"source": "compliance", "attributes": {"priority": "high"}, "value_below": 0},
        "factor": 5,
        "override": True,
    }
)


def test_default_is_the_confidence_weighted_mean() -> None:
    fused = fuse([comp("b", "judge", 1.0, 0.25, weight=2.0), comp("a", "metric", -1.0, 0.5)])
    assert fused is not None
    assert fused.value == pytest.approx((2 * 0.25 * 1.0 + 0.5 * -1.0) / (0.5 + 0.5))
    assert [c.component.event_id for c in fused.contributions] == ["a", "b"]
    assert [c.weight for c in fused.contributions] == [0.5, 0.5]
    assert [c.contribution for c in fused.contributions] == [-0.5, 0.5]
    assert fused.rules_fired == [] and fused.conflicts == [] and fused.adjustments == []
    assert fuse([]) is None


def test_all_zero_weights_give_the_plain_mean() -> None:
    fused = fuse([comp("a", "x", 1.0, 0.0), comp("b", "y", 2.0, 0.0)])
    assert fused is not None and fused.value == 1.5
    assert fused.weights == {"a": 0.5, "b": 0.5}


def test_scale_multiplies_matching_components_before_the_mean() -> None:
    rule = FusionRule(name="double_judge", kind="scale", match={"source": "judge"}, factor=2)
    fused = fuse([comp("a", "judge", 1.0), comp("b", "metric", 0.0)], FusionPolicy(rules=[rule]))
    assert fused is not None and fused.value == 1.0
    assert [c.value for c in fused.contributions] == [2.0, 0.0]
    assert fused.rules_fired == ["double_judge"]
    records = fused.component_records()
    assert records[0]["value"] == 1.0 and records[0]["adjusted_value"] == 2.0 and records[0]["contribution"] == 1.0


def test_override_keeps_only_the_matching_components() -> None:
    rule = FusionRule(name="human_wins", kind="override", match={"annotator": "HUMAN"})
    components = [comp("a", "judge", 1.0, annotator="LLM"), comp("b", "label", -0.5, 0.5, annotator="HUMAN")]
    fused = fuse(components, FusionPolicy(rules=[rule]))
    assert fused is not None and fused.value == -0.5
    assert [(c.weight, c.contribution, c.overridden) for c in fused.contributions] == [
        (0.0, 0.0, True),
        (1.0, -0.5, False),
    ]
    unmatched = fuse(components[:1], FusionPolicy(rules=[rule]))
    assert unmatched is not None and unmatched.value == 1.0 and unmatched.rules_fired == []


def test_the_first_matching_override_wins() -> None:
    rules = [
        FusionRule(name="human", kind="override", match={"annotator": "HUMAN"}),
        FusionRule(name="code", kind="override", match={"annotator": "CODE"}),
    ]
    components = [comp("a", "x", 1.0, annotator="CODE"), comp("b", "y", 3.0, annotator="HUMAN")]
    fused = fuse(components, FusionPolicy(rules=rules))
    assert fused is not None and fused.value == 3.0 and fused.rules_fired == ["human", "code"]
    reordered = fuse(components, FusionPolicy(rules=rules[::-1]))
    assert reordered is not None and reordered.value == 1.0


def test_cap_clamps_the_fused_value_and_records_the_adjustment() -> None:
    rule = FusionRule(name="cap_llm", kind="cap", match={"annotator": "LLM"}, min=-1, max=0.5)
    fused = fuse([comp("a", "judge", 0.9, annotator="LLM"), comp("b", "m", 0.7)], FusionPolicy(rules=[rule]))
    assert fused is not None and fused.value == 0.5 and fused.rules_fired == ["cap_llm"]
    [adjustment] = fused.adjustments
    assert adjustment.rule == "cap_llm" and adjustment.delta == pytest.approx(-0.3)
    assert sum(c.contribution for c in fused.contributions) + adjustment.delta == pytest.approx(fused.value)
    not_matched = fuse([comp("b", "m", 0.7)], FusionPolicy(rules=[rule]))
    assert not_matched is not None and not_matched.value == 0.7 and not_matched.adjustments == []
    inside = fuse([comp("a", "judge", 0.2, annotator="LLM")], FusionPolicy(rules=[rule]))
    assert inside is not None and inside.rules_fired == [] and inside.adjustments == []  # matched, clamped nothing


def test_veto_and_cap_chain_in_declared_order() -> None:
    veto = FusionRule(name="unsafe", kind="veto", match={"source": "safety", "value_below": 0}, value=-1)
    cap = FusionRule(name="floor", kind="cap", min=-0.5)
    components = [comp("a", "judge", 0.9), comp("b", "safety", -0.1)]
    veto_then_cap = fuse(components, FusionPolicy(rules=[veto, cap]))
    cap_then_veto = fuse(components, FusionPolicy(rules=[cap, veto]))
    assert veto_then_cap is not None and veto_then_cap.value == -0.5
    assert cap_then_veto is not None and cap_then_veto.value == -1.0
    assert veto_then_cap.rules_fired == ["unsafe", "floor"]
    assert cap_then_veto.rules_fired == ["unsafe"]  # the floor found 0.4, above it: it changed nothing


def test_component_rules_act_before_result_rules_whatever_their_position() -> None:
    cap = FusionRule(name="cap", kind="cap", max=1)
    scale = FusionRule(name="x10", kind="scale", factor=10)
    fused = fuse([comp("a", "j", 0.5)], FusionPolicy(rules=[cap, scale]))
    assert fused is not None and fused.value == 1.0 and fused.rules_fired == ["x10", "cap"]


def test_the_compliance_example_is_one_rule() -> None:
    policy = FusionPolicy(rules=[COMPLIANCE], conflict_threshold=0.5)
    judge = comp("a", "llm_judge", 0.8, 0.9)
    high = comp("b", "compliance", -0.4, 1.0, attributes={"priority": "high"}, evidence="ticket 12")
    low = comp("c", "compliance", -0.4, 1.0, attributes={"priority": "low"})
    fused = fuse([judge, high, low], policy)
    assert fused is not None
    assert fused.value == pytest.approx(-2.0)
    assert fused.rules_fired == ["compliance_high_negative"]
    assert [c.contribution for c in fused.contributions] == [0.0, pytest.approx(-2.0), 0.0]
    assert {(c.a_event_id, c.b_event_id) for c in fused.conflicts} == {("a", "b"), ("a", "c")}
    assert fused.explanation()["conflicts"][0] == {
        "a_event_id": "a", "b_event_id": "b", "a_value": 0.8, "b_value": pytest.approx(-2.0),
        "difference": pytest.approx(2.8),
    }  # fmt: skip
    positive = fuse([judge, comp("b", "compliance", 0.4, attributes={"priority": "high"})], policy)
    assert positive is not None and positive.rules_fired == []
    assert positive.value == pytest.approx((0.9 * 0.8 + 0.4) / 1.9)


def test_imputed_sources_are_listed() -> None:
    labels = [comp("a", "label", 0.0, imputed=True), comp("c", "label", 0.5, imputed=True)]
    fused = fuse([*labels, comp("b", "judge", 1.0)])
    assert fused is not None and fused.imputed == ["label"]


def test_rules_are_validated() -> None:
    with pytest.raises(ValidationError, match="needs a factor"):
        FusionRule(name="s", kind="scale")
    with pytest.raises(ValidationError, match="needs min, max"):
        FusionRule(name="c", kind="cap")
    with pytest.raises(ValidationError, match="above max"):
        FusionRule(name="c", kind="cap", min=1, max=0)
    with pytest.raises(ValidationError, match="needs a value"):
        FusionRule(name="v", kind="veto")
    with pytest.raises(ValidationError, match="belong to scale"):
        FusionRule(name="v", kind="veto", value=0, factor=2)
    with pytest.raises(ValidationError, match="unique"):
        FusionPolicy(rules=[FusionRule(name="v", kind="veto", value=0)] * 2)
    with pytest.raises(ValidationError):
        FusionRule.model_validate({"name": "x", "kind": "scale", "factor": 1, "match": {"sorce": "typo"}})


def test_the_step_assembler_adapter_keeps_its_interface() -> None:
    dicts = [
        {"event_id": "b", "source": "j", "name": "r", "value": 1.0, "confidence": 0.75, "weight": 1.0,
         "annotator": "LLM", "event_time": 2},
        {"event_id": "a", "source": "m", "name": "r", "value": 0.0, "confidence": 0.25, "weight": 1.0,
         "annotator": "CODE", "event_time": 1},
    ]  # fmt: skip
    fusion = ConfidenceWeightedMean()
    result = fusion.fuse(dicts)
    assert fusion.name == "confidence_weighted_mean"
    assert result is not None and result.status == "complete"
    assert result.value == pytest.approx(0.75) and result.weights == {"a": 0.25, "b": 0.75}
    assert fusion.fuse([]) is None


# --- properties ---------------------------------------------------------------------------------------------------

finite = st.floats(min_value=-100, max_value=100, allow_nan=False)
SOURCES = ["judge", "metric", "compliance", "label"]


@st.composite
def components(draw, min_size: int = 1) -> list[Component]:
    n = draw(st.integers(min_value=min_size, max_value=7))
    ids = draw(st.lists(st.text("0123456789abcdef", min_size=4, max_size=4), min_size=n, max_size=n, unique=True))
    return [
        Component(
            event_id=event_id,
            source=draw(st.sampled_from(SOURCES)),
            name=draw(st.sampled_from(["reward", "safety"])),
            value=draw(finite),
            confidence=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]) | st.floats(0, 1)),
            weight=draw(st.sampled_from([0.0, 1.0, 2.0, 5.0])),
            annotator=draw(st.sampled_from(["LLM", "CODE", "HUMAN"])),
            attributes=draw(st.sampled_from([{}, {"priority": "high"}, {"priority": "low"}])),
            imputed=draw(st.booleans()),
        )
        for event_id in ids
    ]


rules = st.lists(
    st.one_of(
        st.just(COMPLIANCE),
        st.builds(FusionRule, name=st.just("scale"), kind=st.just("scale"), factor=finite,
                  match=st.sampled_from([{}, {"source": "judge"}, {"value_above": 0}])),
        st.builds(FusionRule, name=st.just("cap"), kind=st.just("cap"), min=st.just(-1.0), max=st.just(1.0),
                  match=st.sampled_from([{}, {"annotator": "LLM"}])),
        st.builds(FusionRule, name=st.just("veto"), kind=st.just("veto"), value=finite,
                  match=st.sampled_from([{"source": "label"}, {"value_below": -50}])),
        st.builds(FusionRule, name=st.just("human"), kind=st.just("override"), match=st.just({"annotator": "HUMAN"})),
    ),
    max_size=4,
    unique_by=lambda r: r.name,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(components(), rules, st.none() | st.floats(0, 50), st.randoms())
def test_any_order_gives_the_identical_result(cs, rule_list, threshold, rng) -> None:
    policy = FusionPolicy(rules=rule_list, conflict_threshold=threshold)
    shuffled = list(cs)
    rng.shuffle(shuffled)
    assert fuse(shuffled, policy) == fuse(cs, policy)


@settings(max_examples=200, deadline=None)
@given(components(), rules)
def test_contributions_and_adjustments_sum_to_the_value(cs, rule_list) -> None:
    fused = fuse(cs, FusionPolicy(rules=rule_list))
    assert fused is not None
    total = sum(c.contribution for c in fused.contributions) + sum(a.delta for a in fused.adjustments)
    assert total == pytest.approx(fused.value, abs=1e-9)
    active = [c for c in fused.contributions if not c.overridden]
    assert active and sum(c.weight for c in active) == pytest.approx(1.0)
    assert all(c.weight == 0 and c.contribution == 0 for c in fused.contributions if c.overridden)


@settings(max_examples=200, deadline=None)
@given(components())
def test_default_policy_contributions_sum_to_a_value_within_the_component_range(cs) -> None:
    fused = fuse(cs)
    assert fused is not None
    assert math.fsum(c.contribution for c in fused.contributions) == pytest.approx(fused.value, abs=1e-9)
    values = [c.value for c in cs]
    assert min(values) - 1e-9 <= fused.value <= max(values) + 1e-9
    assert fused.rules_fired == [] and fused.adjustments == [] and fused.conflicts == []


@settings(max_examples=200, deadline=None)
@given(components(), st.sampled_from([{}, {"source": "judge"}, {"value_below": 0}]))
def test_scale_by_one_is_the_identity(cs, match) -> None:
    plain = fuse(cs)
    scaled = fuse(cs, FusionPolicy(rules=[FusionRule(name="one", kind="scale", factor=1, match=match)]))
    assert plain is not None and scaled is not None
    assert scaled.value == plain.value and scaled.contributions == plain.contributions


@settings(max_examples=200, deadline=None)
@given(components(), rules, finite)
def test_a_matching_veto_last_always_yields_its_value(cs, rule_list, veto_value) -> None:
    veto = FusionRule(name="final_veto", kind="veto", value=veto_value, match={"source": cs[0].source})
    fused = fuse(cs, FusionPolicy(rules=[*rule_list, veto]))
    assert fused is not None and fused.value == veto_value and fused.rules_fired[-1] == "final_veto"


@settings(max_examples=200, deadline=None)
@given(components(), rules, st.floats(0, 50))
def test_conflicts_are_exactly_the_cross_source_pairs_beyond_the_threshold(cs, rule_list, threshold) -> None:
    fused = fuse(cs, FusionPolicy(rules=rule_list, conflict_threshold=threshold))
    assert fused is not None
    post = {c.component.event_id: c for c in fused.contributions}
    found = {frozenset((c.a_event_id, c.b_event_id)) for c in fused.conflicts}
    expected = {
        frozenset((a, b))
        for a in post
        for b in post
        if a != b
        and post[a].component.source != post[b].component.source
        and abs(post[a].value - post[b].value) > threshold
    }
    assert found == expected  # symmetric by construction of `expected`: the pair, not its order, is the conflict
    for c in fused.conflicts:
        assert c.a_event_id < c.b_event_id
        assert c.difference == abs(c.a_value - c.b_value) > threshold
        assert (c.a_value, c.b_value) == (post[c.a_event_id].value, post[c.b_event_id].value)
