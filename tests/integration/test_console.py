"""The debug console in a real browser: Debian's headless Chromium driven by Playwright, over a real pipeline.

One workload for the module (a real broker, a worker with the step and state processors, its sink serving SQL):
a session with rewards in time, a late one, a duplicate, an orphan, a conflict, an imputed part, state deltas and
two dead letters, plus a second agent's session. `treadle console` runs as a subprocess, as a user starts it.
The tests click through every page and compare what it shows with SQL, then watch live updates arrive while
the SDK sends new steps. Screenshots of every page go to .treadle/artifacts/console/ (printed in the log); with
TREADLE_DOCS_SCREENSHOT=1 the timeline is also saved as docs/console.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

import playwright.sync_api as playwright_sync  # the test extra: a missing one fails, never skips
import pytest

from sinks.sql_client import run_sql
from streams.runtime.worker import prepare_cluster
from tests.conftest import PORT_BASE
from tests.factories import RawProducer, dispatch, envelope, result, reward, wait_for
from tests.paths import REPO_ROOT
from topics.ids import uuid7
from topics.names import DISPATCH, LIFECYCLE, REWARD, STATE_DELTA, TOOL_RESULT
from topics.settings import Settings
from treadle.devstack.worker_process import WorkerProcess
from treadle.reports.explain import fetch_explanation
from treadle.state.history import diff, state_at

pytestmark = pytest.mark.integration


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
ARTIFACTS = REPO_ROOT / ".treadle" / "artifacts" / "console"
S = 1_000_000
POLICY = {
    "version": "console-test-1",
    "default_window_s": 1000,
    "orphan_wait_s": 30,
    "specs": [
        {"source": "judge", "window_s": 10, "grace_s": 5, "required": True},
        {"source": "human", "window_s": 100, "required": True, "imputation": "default", "default_value": 0.0},
        {"source": "metric", "window_s": 50, "weight": 2.0},
    ],
    "fusion": {"conflict_threshold": 1.0},
}
KIND = {DISPATCH: "actions", TOOL_RESULT: "tool_results", REWARD: "rewards", STATE_DELTA: "state_deltas",
        LIFECYCLE: "lifecycle"}  # fmt: skip


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's chromium; installed with apt-get when missing and we are root (Playwright cannot download one)."""
    if not CHROMIUM.exists():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.fail("no /usr/bin/chromium and no way to install it: run `apt-get install chromium` as root")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env, timeout=900)
    return CHROMIUM


class Workload:
    """The events sent, and the ids the tests look for."""

    def __init__(self, run: str) -> None:
        self.main, self.other = f"cs-main-{run}", f"cs-other-{run}"
        self.lids = [uuid7() for _ in range(3)]
        self.orphan_lid = uuid7()
        self.events: list[tuple[str, dict]] = []
        self.seq = 0
        self.base = int(time.time() * S) - 3 * 86_400 * S  # days ago: idle watermarks pass every window at once

    def send(self, schema: str, record: dict, at: int) -> dict:
        record["envelope"]["event_time"] = at
        record["envelope"]["agent_id"] = "console-agent" if record["envelope"]["session_id"] == self.main else "other"
        record["envelope"]["policy_version"] = "pv-1" if record["envelope"]["session_id"] == self.main else "pv-2"
        self.events.append((schema, record))
        return record

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def lifecycle(self, session: str, kind: str, at: int) -> None:
        lid = uuid7()
        record = {"envelope": envelope(session, lid, self.next_seq()), "kind": kind, "done": kind == "EPISODE_ENDED",
                  "truncated": False, "reason": None, "reward": None, "steps": None}  # fmt: skip
        self.send(LIFECYCLE, record, at)

    def delta(self, session: str, at: int, ups=(), dels=(), edges=()) -> None:
        record = {
            "envelope": envelope(session, uuid7(), self.next_seq()),
            "node_upserts": [{"id": i, "type": t, "data_json": json.dumps(d), "ttl_seconds": None} for i, t, d in ups],
            "node_deletes": list(dels),
            "edge_upserts": [{"src": s, "dst": d, "type": k, "data_json": "{}"} for s, d, k in edges],
            "edge_deletes": [],
            "rollback_to": None,
        }
        self.send(STATE_DELTA, record, at)

    def build(self) -> None:
        t, m = self.base, self.main
        self.lifecycle(m, "SESSION_CREATED", t)
        self.delta(m, t + S, ups=[("doc-1", "doc", {"title": "draft"}), ("doc-2", "doc", {"title": "notes"})],
                   edges=[("doc-1", "doc-2", "references")])  # fmt: skip
        for i, lid in enumerate(self.lids):
            at = t + (10 + i * 100) * S
            self.send(DISPATCH, dispatch(m, lid, i, self.next_seq()), at)
            status = "ERROR" if i == 1 else "OK"
            self.send(TOOL_RESULT, result(m, lid, self.next_seq(), status=status, latency=150.0 + i), at + S // 5)
            if i == 0:  # complete: judge and human in time, a metric too
                self.send(REWARD, reward(m, lid, self.next_seq(), 0.8, "judge", 0.9), at + 2 * S)
                self.send(REWARD, reward(m, lid, self.next_seq(), 1.0, "metric"), at + 20 * S)
                self.send(REWARD, reward(m, lid, self.next_seq(), 1.0, "human"), at + 60 * S)
            if i == 1:  # the judge 5 s past its grace: late; human never comes: imputed
                self.send(REWARD, reward(m, lid, self.next_seq(), 0.5, "judge"), at + 20 * S)
            if i == 2:  # the judge twice (a duplicate), a human label far from it (a conflict)
                judged = self.send(REWARD, reward(m, lid, self.next_seq(), -0.5, "judge"), at + 3 * S)
                self.events.append((REWARD, judged))
                self.send(REWARD, reward(m, lid, self.next_seq(), 1.0, "human"), at + 50 * S)
        self.delta(m, t + 250 * S, ups=[("doc-1", "doc", {"title": "final"}), ("doc-3", "doc", {"title": "summary"})],
                   dels=["doc-2"], edges=[("doc-3", "doc-1", "references")])  # fmt: skip
        self.send(REWARD, reward(m, self.orphan_lid, self.next_seq(), 0.3, "judge"), t + 300 * S)
        self.lifecycle(m, "EPISODE_ENDED", t + 400 * S)
        other_lid = uuid7()
        self.send(DISPATCH, dispatch(self.other, other_lid, 0, self.next_seq()), t + 500 * S)
        self.send(REWARD, reward(self.other, other_lid, self.next_seq(), 0.1, "judge"), t + 501 * S)


async def produce(settings: Settings, workload: Workload) -> None:
    async with RawProducer(settings) as producer:
        for schema, record in workload.events:
            topic = producer.catalog[KIND[schema]].name
            key = record["envelope"]["session_id"].encode()
            await producer.producer.send(topic, producer.codec.encode(schema, record), key=key)
        bad = reward(workload.main, workload.lids[0], 999, 0.5, "judge", 2.0)  # confidence 2: VALIDATE
        bad["envelope"]["event_time"] = workload.base
        await producer.producer.send(producer.catalog["rewards"].name, producer.codec.encode(REWARD, bad),
                                     key=workload.main.encode())  # fmt: skip
        await producer.send_bytes("rewards", b"\x00not avro at all", key=workload.main.encode())  # DECODE
        await producer.flush()


def sql(settings: Settings, query: str, **params: object) -> list[list]:
    return run_sql(settings, query, params=params or None)[1]


class Console:
    """`treadle console` as a subprocess on a free port."""

    def __init__(self, settings: Settings, port: int, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = settings.home / f"console-{port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "treadle.cli", "console", "--port", str(port)],
            cwd=REPO_ROOT,
            env={**os.environ, **settings.to_env(), **(env or {})},
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, headers: dict[str, str] | None = None) -> None:
        def up() -> bool:
            try:
                request = urllib.request.Request(self.url + "/validate", headers=headers or {})
                with urllib.request.urlopen(request, timeout=5) as response:
                    return response.status == 200
            except (urllib.error.URLError, ConnectionError):
                assert self.process.poll() is None, self.log.read_text()
                return False

        wait_for(up, 60, "the console to answer")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def pipeline(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, Workload]]:
    """A worker (steps + state) that has folded the workload, its sink serving SQL; the last rows are in."""
    home = tmp_path_factory.mktemp("console")
    policy = home / "policy.json"
    policy.write_text(json.dumps(POLICY))
    name = f"c{os.getpid()}x{uuid7()[-6:]}"
    settings = stack.model_copy(
        update={
            "home": home / "home", "topic_prefix": name, "app_id": name, "processors": ("steps", "state"),
            "web_port": PORT_BASE - 1400 + (os.getpid() % 100), "sql_port": PORT_BASE - 1300 + (os.getpid() % 100),
            "sink_flush_seconds": 0.2, "reward_policy": policy, "idle_timeout_s": 2.0, "watermark_lag_s": 1.0,
            "window_tick_s": 0.5,
        }
    )  # fmt: skip
    asyncio.run(prepare_cluster(settings))
    worker = WorkerProcess(settings, settings.home / "worker.log").start()
    try:
        worker.wait_ready()
        workload = Workload(uuid7()[-8:])
        workload.build()
        asyncio.run(produce(settings, workload))

        def settled() -> bool:
            steps = sql(settings, "SELECT countIf(reward_status != 'pending') FROM transitions_latest "
                                  "WHERE session_id IN ({a:String}, {b:String})",
                        a=workload.main, b=workload.other)  # fmt: skip
            late = sql(
                settings, "SELECT count() FROM late_rewards_latest WHERE session_id = {s:String}", s=workload.main
            )
            dead = sql(
                settings, "SELECT count() FROM dead_letters_latest WHERE session_id = {s:String}", s=workload.main
            )
            versions = sql(settings, "SELECT count() FROM state_versions_latest WHERE session_id = {s:String}",
                           s=workload.main)  # fmt: skip
            return steps[0][0] == 4 and late[0][0] == 2 and dead[0][0] == 2 and versions[0][0] >= 8

        wait_for(settled, 180, "every step closed, two late rows, two dead letters and the state versions")
        yield settings, workload
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def console(pipeline: tuple[Settings, Workload]) -> Iterator[Console]:
    settings, _ = pipeline
    server = Console(settings, PORT_BASE - 1200 + (os.getpid() % 100))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(chromium: Path) -> Iterator[object]:
    with playwright_sync.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    try:
        yield tab
    finally:
        context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def cell_int(page, selector: str) -> int:
    return int(page.locator(selector).inner_text().strip())


def test_sessions_list_to_timeline_to_explanation_shows_what_sql_says(pipeline, console, page) -> None:
    settings, w = pipeline
    page.goto(f"{console.url}/sessions")
    row = page.locator(f'tr[data-session="{w.main}"]')
    row.wait_for()
    shot(page, "1-sessions")
    want_dead = sql(settings, "SELECT count() FROM dead_letters_latest WHERE session_id = {s:String}", s=w.main)[0][0]
    late = sql(settings, "SELECT countIf(reason = 'AFTER_GRACE'), countIf(reason = 'ORPHAN') FROM late_rewards_latest "
                         "WHERE session_id = {s:String}", s=w.main)[0]  # fmt: skip
    assert cell_int(page, f'tr[data-session="{w.main}"] td.steps') == 3
    assert cell_int(page, f'tr[data-session="{w.main}"] td.dead') == want_dead == 2
    assert cell_int(page, f'tr[data-session="{w.main}"] td.late') == late[0] == 1
    assert cell_int(page, f'tr[data-session="{w.main}"] td.orphans') == late[1] == 1
    assert row.locator("td.status").inner_text() == "ended"
    assert page.locator(f'tr[data-session="{w.other}"] td.status').inner_text() == "open"

    # filters: agent, status, search by a step id, sort
    page.select_option('select[name="agent"]', "other")
    page.click("#session-filters button")
    page.wait_for_url("**agent=other**")
    assert page.locator("#sessions tbody tr[data-session]").count() == 1
    page.goto(f"{console.url}/sessions?q={w.lids[1]}")
    assert [r.get_attribute("data-session") for r in page.locator("#sessions tbody tr[data-session]").all()] == [w.main]
    page.goto(f"{console.url}/sessions?status=open&q=cs-")
    assert w.main not in page.locator("#sessions").inner_text()
    main_start = datetime.fromtimestamp(w.base / S, UTC)
    page.goto(
        f"{console.url}/sessions?q=cs-&until={(main_start + timedelta(seconds=30)).strftime('%Y-%m-%dT%H:%M:%S')}"
    )
    assert [r.get_attribute("data-session") for r in page.locator("#sessions tbody tr[data-session]").all()] == [w.main]
    page.goto(
        f"{console.url}/sessions?q=cs-&since={(main_start + timedelta(seconds=450)).strftime('%Y-%m-%dT%H:%M:%S')}"
    )
    assert [r.get_attribute("data-session") for r in page.locator("#sessions tbody tr[data-session]").all()] == [
        w.other
    ]
    page.goto(f"{console.url}/sessions?q=cs-&sort=steps&order=desc")
    first = page.locator("#sessions tbody tr[data-session]").first.get_attribute("data-session")
    assert first == w.main

    page.goto(f"{console.url}/sessions?q={w.main}")
    page.click(f'tr[data-session="{w.main}"] a.session-link')
    page.wait_for_url(f"**/sessions/{w.main}")
    page.locator("#timeline").wait_for()
    shot(page, "2-timeline")
    if os.environ.get("TREADLE_DOCS_SCREENSHOT") == "1":
        page.set_viewport_size({"width": 1100, "height": 640})
        page.screenshot(path=str(REPO_ROOT / "docs" / "console.png"), full_page=False)
    assert page.locator("tr.step").count() == 3
    assert page.locator('[data-count="late"]').inner_text() == "1"
    assert page.locator('[data-count="orphans"]').inner_text() == "1"
    late_id = sql(settings, "SELECT event_id FROM late_rewards_latest WHERE session_id = {s:String} "
                            "AND reason = 'AFTER_GRACE'", s=w.main)[0][0]  # fmt: skip
    assert page.locator(f'circle.reward.late[data-event-id="{late_id}"]').count() == 1
    assert page.locator(f'tr.reward-row.late[data-event-id="{late_id}"]').count() == 1
    assert page.locator("#orphans tr.reward-row.orphan").count() == 1
    rewards = sql(settings, "SELECT step, reward FROM transitions_latest WHERE session_id = {s:String} ORDER BY step",
                  s=w.main)  # fmt: skip
    for step, value in rewards:
        shown = page.locator(f'tr.step[data-step="{step}"] td.reward').get_attribute("data-reward")
        assert (float(shown) if shown else None) == pytest.approx(value)

    page.click('tr.step[data-step="2"] a.step-link')
    page.wait_for_url(f"**/steps/{w.lids[2]}")
    shot(page, "3-explanation")
    want = fetch_explanation(partial(run_sql, settings), w.lids[2])
    assert float(page.locator("#reward-value").get_attribute("data-value")) == pytest.approx(want.value)
    assert page.locator("#components tbody tr[data-event-id]").count() == len(want.components) == 2
    assert page.locator("#conflicts tbody tr").count() == len(want.conflicts) == 1
    shown = json.loads(page.locator("#explain-json").text_content())
    assert shown == json.loads(json.dumps(want.as_json(), default=str))  # the data `treadle explain --json` prints


def test_state_explorer_moves_between_versions_and_diffs_them(pipeline, console, page) -> None:
    settings, w = pipeline
    page.goto(f"{console.url}/sessions/{w.main}/state")
    page.locator("#version-id").wait_for()
    versions = sql(settings, "SELECT ordinal, version_id FROM state_versions_latest WHERE session_id = {s:String} "
                             "ORDER BY ordinal", s=w.main)  # fmt: skip
    assert page.locator("#version-id").inner_text() == versions[-1][1]
    latest = state_at(settings, w.main, versions[-1][1])
    assert cell_int(page, "#node-count") == len(latest.nodes)
    assert page.locator('#nodes tr[data-node-id="doc-3"]').count() == 1
    assert page.locator('#nodes tr[data-node-id="doc-2"]').count() == 0
    shot(page, "4-state-latest")

    first_delta = next(o for o, _ in versions if "doc-1" in state_at(settings, w.main, o).nodes)
    slider = page.locator("#version-slider")
    slider.fill(str(first_delta))  # a range input: fill moves it and fires change, which submits the form
    page.wait_for_url(f"**at={first_delta}**")
    assert page.locator("#version-id").inner_text() == versions[first_delta - 1][1]
    assert page.locator('#nodes tr[data-node-id="doc-2"]').count() == 1

    # Asked for by that version's time: the state at a time is the last version at or before it, which is this one
    # unless an event applied late (its seq's turn passed while its topic lagged, as on a loaded machine) shares
    # its time; the Python API says which.
    at_time = state_at(settings, w.main, first_delta).time
    moment = datetime.fromtimestamp(at_time // 1_000_000, UTC).replace(microsecond=at_time % 1_000_000)
    page.goto(f"{console.url}/sessions/{w.main}/state")
    page.fill("#at-text", moment.isoformat())
    page.click("#at-form button")
    page.wait_for_url("**at=**")
    at_moment = state_at(settings, w.main, moment)
    assert at_moment.ordinal >= first_delta and at_moment.time == at_time
    assert page.locator("#version-id").inner_text() == at_moment.version_id
    assert page.locator('#nodes tr[data-node-id="doc-2"]').count() == 1

    page.select_option("#diff-from", str(first_delta))
    page.locator("#version-slider").fill(str(versions[-1][0]))
    page.wait_for_url("**diff_from=**")
    page.locator("#diff").wait_for()
    shot(page, "5-state-diff")
    want = diff(state_at(settings, w.main, first_delta), state_at(settings, w.main, versions[-1][0])).to_json()
    assert page.locator("#diff tr.added").count() == len(want["nodes_added"]) + len(want["edges_added"])
    assert page.locator("#diff tr.removed").count() == len(want["nodes_removed"]) + len(want["edges_removed"])
    assert page.locator("#diff tr.changed").count() == len(want["nodes_changed"])
    assert "doc-2" in page.locator("#diff tr.removed").first.inner_text()
    assert any(c["after"]["id"] == "doc-1" for c in want["nodes_changed"])


def test_reward_flow_counts_match_sql(pipeline, console, page) -> None:
    settings, _ = pipeline
    page.goto(f"{console.url}/rewards?policy=pv-1")
    page.locator('#reward-sources tr[data-source="judge"]').wait_for()
    shot(page, "6-reward-flow")
    late = dict(sql(settings, "SELECT source, countIf(reason = 'AFTER_GRACE') FROM late_rewards_latest "
                              "WHERE policy_version = 'pv-1' GROUP BY source"))  # fmt: skip
    received = dict(sql(settings, "SELECT source, uniqExact(event_id) FROM reward_components "
                                  "WHERE policy_version = 'pv-1' GROUP BY source"))  # fmt: skip
    for source in ("judge", "human", "metric"):
        row = f'#reward-sources tr[data-source="{source}"]'
        assert cell_int(page, f"{row} td.received") == received[source]
        assert cell_int(page, f"{row} td.late") == late.get(source, 0)
    assert cell_int(page, '#reward-sources tr[data-source="judge"] td.late') == 1
    assert cell_int(page, '#reward-sources tr[data-source="judge"] td.orphans') == 1
    assert cell_int(page, '#reward-sources tr[data-source="human"] td.imputed') == 1  # step 1's human was imputed
    assert cell_int(page, '#reward-sources tr[data-source="judge"] td.conflicts') >= 1
    judge_chart = page.locator('figure[data-source="judge"] rect.bar.late')
    assert sum(int(b.get_attribute("data-count")) for b in judge_chart.all()) >= 1


def test_dead_letters_and_the_validator_agree_with_the_worker(pipeline, console, page) -> None:
    settings, w = pipeline
    page.goto(f"{console.url}/dead-letters")
    page.locator("#dead-letter-groups").wait_for()
    shot(page, "7-dead-letters")
    groups = sql(settings, "SELECT stage, reason, count() FROM dead_letters_latest WHERE session_id = {s:String} "
                           "GROUP BY stage, reason", s=w.main)  # fmt: skip
    validate_reason = next(r for stage, r, _ in groups if stage == "VALIDATE")
    assert validate_reason in page.locator("#dead-letter-groups").inner_text()
    assert page.locator("article.dead-letter pre.decoded").count() >= 1  # the VALIDATE letter decodes
    assert page.locator("article.dead-letter p.undecodable").count() >= 1  # the DECODE one cannot

    page.goto(f"{console.url}/validate")
    text = page.locator("#event-json").input_value()
    page.fill("#event-json", text.replace('"confidence": 0.9', '"confidence": 2.0'))
    page.click("#check")
    page.locator("#verdict").wait_for()
    shot(page, "8-validator")
    assert page.locator("#verdict-stage").inner_text() == "VALIDATE"
    assert page.locator("#verdict-reason").inner_text() == validate_reason  # the reason the worker recorded
    page.fill("#event-json", text.replace('"event_id"', '"event_idx"'))
    page.click("#check")
    assert page.locator("#verdict-stage").inner_text() == "SCHEMA"
    page.fill("#event-json", text)
    page.click("#check")
    assert page.locator("#verdict").inner_text().startswith("valid")


def test_hostile_filters_are_harmless(pipeline, console) -> None:
    settings, w = pipeline
    before = sql(settings, "SELECT count() FROM transitions")[0][0]
    hostile = [
        "x' OR '1'='1",
        "'; DROP TABLE transitions; --",
        "\\' OR 1=1 --",
        "') UNION SELECT name FROM system.users --",
    ]
    fields = ["agent", "policy", "q", "since", "until", "status", "sort", "order", "page", "size"]
    for value in hostile:
        for name in fields:
            query = urllib.parse.urlencode({name: value})
            for path in (f"/sessions?{query}", f"/rewards?{query}", f"/dead-letters?{query}",
                         f"/sessions/{urllib.parse.quote(value, safe='')}?{query}",
                         f"/sessions/{w.main}/state?at={urllib.parse.quote(value)}&diff_from={urllib.parse.quote(value)}",
                         f"/steps/{urllib.parse.quote(value, safe='')}"):  # fmt: skip
                try:
                    with urllib.request.urlopen(console.url + path, timeout=30) as response:
                        status, body = response.status, response.read().decode()
                except urllib.error.HTTPError as exc:
                    status, body = exc.code, exc.read().decode()
                assert status in (200, 400, 404), (path, status, body[-400:])
                if name in ("agent", "policy", "q") and path.startswith("/sessions?"):
                    assert status == 200 and "no sessions match" in body, path
    assert sql(settings, "SELECT count() FROM transitions")[0][0] == before
    # the bound parameter reads back exactly what was typed, through the sink's SQL service
    for value in [*hostile, "ünï\n\t\x01"]:
        assert sql(settings, "SELECT {v:String}", v=value)[0][0] == value


def test_live_updates_arrive_without_reloading(pipeline, console, page) -> None:
    from treadle import AgentStreamSync, RewardEmitterSync

    settings, _ = pipeline
    session = f"cs-live-{uuid7()[-8:]}"
    page.goto(f"{console.url}/sessions?q=cs-live")
    page.locator("#live-status.on").wait_for()
    page.evaluate("window.__notReloaded = true")
    with AgentStreamSync(settings, agent_id="live-agent", session_id=session, policy_version="pv-live") as stream:
        step = stream.dispatch("search", {"q": "live"})
        page.locator(f'tr[data-session="{session}"]').wait_for(timeout=60_000)
        assert page.evaluate("window.__notReloaded") is True
        shot(page, "9-live-sessions")

        page.goto(f"{console.url}/sessions/{session}")
        page.locator("#live-status.on").wait_for()
        page.evaluate("window.__notReloaded = true")
        assert page.locator("tr.step").count() == 1
        stream.tool_result(step, status="OK", output="found", latency_ms=5.0)
        with RewardEmitterSync(source="judge", settings=settings) as judge:
            judge.reward(step, 0.9, name="quality")
        stream.dispatch("search", {"q": "again"})
        page.locator("tr.step").nth(1).wait_for(timeout=60_000)  # the second step, swapped in by the live stream
        assert page.evaluate("window.__notReloaded") is True
        assert int(page.locator("#live").get_attribute("data-updates")) >= 1
        shot(page, "10-live-timeline")


def test_a_token_protected_console_refuses_requests_without_the_token(pipeline, page) -> None:
    settings, w = pipeline
    token = f"tok-{uuid7()}"
    server = Console(settings, PORT_BASE - 1100 + (os.getpid() % 100), env={"TREADLE_CONSOLE_TOKEN": token})
    try:
        server.wait_ready(headers={"Authorization": f"Bearer {token}"})
        for path in ("/sessions", f"/sessions/{w.main}", "/static/console.js", "/live/sessions", "/validate"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(server.url + path, timeout=10)
            assert refused.value.code == 401, path
        request = urllib.request.Request(server.url + "/sessions", headers={"Authorization": "Bearer wrong"})
        with pytest.raises(urllib.error.HTTPError) as wrong:
            urllib.request.urlopen(request, timeout=10)
        assert wrong.value.code == 401

        page.goto(f"{server.url}/sessions?q={w.main}&token={token}")  # once: a cookie, then the URL without it
        page.locator(f'tr[data-session="{w.main}"]').wait_for()
        assert "token" not in page.url
        page.click(f'tr[data-session="{w.main}"] a.session-link')  # the cookie carries the next requests
        page.locator("#timeline").wait_for()
        page.locator("#live-status.on").wait_for()  # the live stream too
    finally:
        server.stop()
    assert token not in server.log.read_text()  # never logged
