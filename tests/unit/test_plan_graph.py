"""treadle.reports.plan_graph: layers by dependency depth and the critical path, with hypothesis properties on
random DAGs against a brute-force oracle (every chain enumerated)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.reports.plan_graph import (
    Attempt,
    Interval,
    PlanGraphError,
    PlanView,
    SubgoalView,
    critical_path,
    layers,
    render_text,
)

DIAMOND = {"fetch": [], "train": ["fetch"], "lint": ["fetch"], "report": ["train", "lint"]}


def test_layers_follow_dependency_depth_in_plan_order() -> None:
    assert layers(DIAMOND) == [["fetch"], ["train", "lint"], ["report"]]
    assert layers({"a": [], "b": [], "c": ["a"], "d": ["c", "b"]}) == [["a", "b"], ["c"], ["d"]]
    assert layers({}) == []


def test_the_critical_path_is_the_longest_chain_by_duration() -> None:
    assert critical_path(DIAMOND, {"fetch": 3, "train": 16, "lint": 9, "report": 3}) == (
        ["fetch", "train", "report"],
        22.0,
    )
    assert critical_path(DIAMOND, {"fetch": 3, "train": 1, "lint": 9, "report": 3}) == (
        ["fetch", "lint", "report"],
        15.0,
    )
    # a long independent subgoal beats a chain of short ones; missing durations count as 0
    assert critical_path({"a": [], "b": ["a"], "z": []}, {"a": 1, "b": 1, "z": 5}) == (["z"], 5.0)
    assert critical_path({"a": [], "b": ["a"]}, {}) == (["a"], 0.0)  # ties: the earlier subgoal, the shorter chain
    assert critical_path({}, {}) == ([], 0.0)


def test_a_refused_plan_is_a_readable_error() -> None:
    with pytest.raises(PlanGraphError, match="cycle through a, b"):
        layers({"a": ["b"], "b": ["a"], "c": []})
    with pytest.raises(PlanGraphError, match="depends on unknown subgoal 'x'"):
        critical_path({"a": ["x"]}, {})


def test_render_text_marks_the_critical_path_and_lists_attempts() -> None:
    def sub(sid: str, deps: tuple[str, ...], ready: int, ended: int, *attempts: Attempt) -> SubgoalView:
        history = [Interval("READY", 1, ready, ended), Interval("SUCCEEDED", 1, ended, None)]
        return SubgoalView(sid, deps, "cpu", f"tool_{sid}", history, list(attempts))

    ok = Attempt(1, "cpu-1", "cpu", "SUCCEEDED", "", 2.0)
    plan = PlanView(
        "s1", "p1", "ship it", 0,
        {"a": sub("a", (), 0, 3_000_000, ok), "b": sub("b", ("a",), 3_000_000, 4_000_000, ok),
         "c": sub("c", ("a",), 3_000_000, 9_000_000, Attempt(1, "cpu-1", "cpu", "FAILED", "OOM", 1.0), ok)},
        outcome="SUCCEEDED", finished_at=9_000_000,
    )  # fmt: skip
    text = "\n".join(render_text(plan))
    assert "plan p1 (session s1): SUCCEEDED, 3 subgoals" in text and "finished after 9.0 s" in text
    assert "critical path: a -> c (9.0 s)" in text
    assert "  * c  SUCCEEDED  [cpu]  2 attempt(s)  6.0 s  <- a" in text
    assert "    b  SUCCEEDED  [cpu]  1 attempt(s)  1.0 s  <- a" in text
    assert "#1 on cpu-1: FAILED (OOM) 1.0 s" in text
    assert text.index("layer 0") < text.index("* a") < text.index("layer 1") < text.index("* c")


def test_render_text_shows_the_reward_sum_of_subgoals_with_steps() -> None:
    history = [Interval("READY", 1, 0, 2_000_000), Interval("SUCCEEDED", 1, 2_000_000, None)]
    ok = Attempt(1, "cpu-1", "cpu", "SUCCEEDED", "", 2.0)
    rewarded = SubgoalView("a", (), "cpu", "t", list(history), [ok], steps=3, rewarded_steps=2, reward_sum=1.25)
    plain = SubgoalView("b", ("a",), "cpu", "t", [], [])
    text = "\n".join(render_text(PlanView("s1", "p1", "", 0, {"a": rewarded, "b": plain})))
    assert "  * a  SUCCEEDED  [cpu]  1 attempt(s)  2.0 s  reward 1.25 (2/3 steps)\n" in text + "\n"
    assert "    b  WAITING  [cpu]  0 attempt(s)  -  <- a" in text  # no steps: the line as before


# -- properties ------------------------------------------------------------------------------------------------------


@st.composite
def dags(draw: st.DrawFn) -> tuple[dict[str, list[str]], dict[str, float]]:
    """A random DAG (each node depends only on earlier ones), listed in a random order, with durations."""
    n = draw(st.integers(0, 9))
    ids = [f"n{i}" for i in range(n)]
    deps = {sid: sorted(draw(st.sets(st.sampled_from(ids[:i])))) if i else [] for i, sid in enumerate(ids)}
    order = draw(st.permutations(ids))
    durations = {sid: draw(st.floats(0, 100, allow_nan=False)) for sid in ids}
    return {sid: deps[sid] for sid in order}, durations


def all_chains(depends_on: dict[str, list[str]]) -> list[list[str]]:
    """Every path along dependency edges (brute force)."""
    dependents = {sid: [s for s, deps in depends_on.items() if sid in deps] for sid in depends_on}
    chains: list[list[str]] = []

    def walk(chain: list[str]) -> None:
        chains.append(chain)
        for nxt in dependents[chain[-1]]:
            walk([*chain, nxt])

    for sid in depends_on:
        walk([sid])
    return chains


@settings(max_examples=300, deadline=None)
@given(dags())
def test_layering_respects_every_edge(dag: tuple[dict[str, list[str]], dict[str, float]]) -> None:
    depends_on, _ = dag
    found = layers(depends_on)
    depth = {sid: d for d, ids in enumerate(found) for sid in ids}
    assert sorted(depth) == sorted(depends_on) and sum(map(len, found)) == len(depends_on)  # each node once
    for sid, deps in depends_on.items():
        assert all(depth[d] < depth[sid] for d in deps)
        assert depth[sid] == (1 + max(depth[d] for d in deps) if deps else 0)  # as shallow as its edges allow
    assert all(found)  # no empty layer


@settings(max_examples=300, deadline=None)
@given(dags())
def test_the_critical_path_is_a_longest_chain(dag: tuple[dict[str, list[str]], dict[str, float]]) -> None:
    depends_on, durations = dag
    path, total = critical_path(depends_on, durations)
    if not depends_on:
        assert (path, total) == ([], 0.0)
        return
    assert all(a in depends_on[b] for a, b in pairwise(path))  # it follows dependency edges
    assert total == pytest.approx(sum(durations[s] for s in path))
    best = max(sum(durations[s] for s in chain) for chain in all_chains(depends_on))
    assert total == pytest.approx(best)


def test_png_without_matplotlib_is_one_readable_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import sys

    from treadle.reports.plan_view import draw_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the reports extra were not installed
    plan = PlanView("s1", "p1", "", 0, {"a": SubgoalView("a", (), "cpu", "t")})
    with pytest.raises(ModuleNotFoundError, match=r"--png needs matplotlib: pip install 'treadle\[reports\]'"):
        draw_png(plan, tmp_path / "p.png")
