"""Console page render times over the SQL service: `python -m bench.console_bench [--sessions 100000] [--steps 8]`.

A child process plays the sink: it owns embedded chDB (a fresh folder), lands synthetic rows straight into the
migrated tables with `INSERT … SELECT FROM numbers()` (sessions x steps transitions carrying two reward components
each, the components themselves, one woven reward per step, late rewards for 5% of steps, dead letters for 1% of
sessions, lifecycle events with half the sessions ended) and serves `sinks.service.sql_app` on 127.0.0.1, the
endpoint `treadle sql` and the console use while a worker runs. This process runs the console application and times
whole HTTP requests (query through the service + template render), --renders rounds over the pages: p50, p95 per page.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import REPO_ROOT, machine_facts

BASE_US = 1_760_000_000_000_000
PORT = 29468 + int(os.environ.get("TREADLE_BENCH_PORT_SHIFT", "0"))
CONSOLE_PORT = PORT + 1


def fill_sql(sessions: int, steps: int) -> list[str]:
    """The statements that land the synthetic workload; `s` is the session number, `k` the step."""
    n = sessions * steps
    session = f"concat('bs-', toString(intDiv(number, {steps})))"
    lid = "concat('bl-', toString(number))"
    at = f"fromUnixTimestamp64Micro(toInt64({BASE_US} + number * 1000000), 'UTC')"
    return [
        f"""INSERT INTO transitions (session_id, step, logical_event_id, revision, agent_id, episode_id, trace_id,
            policy_version, tool, params_json, dispatched_at, tool_status, latency_ms, cost_usd, result_at, reward,
            reward_status, reward_revision, updated_at, `reward_components.event_id`, `reward_components.source`,
            `reward_components.name`, `reward_components.value`, `reward_components.confidence`,
            `reward_components.weight`, `reward_components.annotator`, `reward_components.event_time`,
            `reward_components.contribution`, `reward_components.adjusted_value`, `reward_components.lateness_ms`,
            `reward_components.evidence`, `reward_components.imputed`)
        SELECT {session}, number % {steps}, {lid}, 4, concat('agent-', toString(intDiv(number, {steps}) % 20)),
            concat({session}, '-ep0'), '', concat('pv-', toString(intDiv(number, {steps}) % 3)), 'search', '{{}}',
            {at}, if(number % 10 = 0, 'ERROR', 'OK'), number % 500, 0.001, {at} + INTERVAL 1 SECOND,
            (number % 200) / 100 - 1, 'complete', 2, {at} + INTERVAL 60 SECOND,
            [concat('rc-', toString(2 * number)), concat('rc-', toString(2 * number + 1))], ['judge', 'human'],
            ['quality', 'quality'], [0.4, 0.6], [1, 1], [1, 1], ['LLM', 'HUMAN'],
            [{at} + toIntervalSecond(number % 40), {at} + toIntervalSecond(number % 90)], [0.2, 0.3], [0.4, 0.6],
            [0, 0], [NULL, NULL], [false, number % 20 = 0]
        FROM numbers({n})""",
        f"""INSERT INTO reward_components (logical_event_id, session_id, event_id, agent_id, episode_id, source, name,
            value, confidence, annotator, event_time, policy_version, trace_id, ingested_revision)
        SELECT concat('bl-', toString(intDiv(number, 2))), concat('bs-', toString(intDiv(number, {2 * steps}))),
            concat('rc-', toString(number)), 'judge', '', if(number % 2 = 0, 'judge', 'human'), 'quality',
            (number % 100) / 100, 1, 'LLM',
            fromUnixTimestamp64Micro(toInt64({BASE_US} + intDiv(number, 2) * 1000000 + (number % 40) * 1000000), 'UTC'),
            concat('pv-', toString(intDiv(number, {2 * steps}) % 3)), '', 1
        FROM numbers({2 * n})""",
        f"""INSERT INTO woven_rewards (logical_event_id, session_id, episode_id, step, revision, value, status, fusion,
            policy_version, `components.event_id`, `components.source`, `components.name`, `components.value`,
            `components.confidence`, `components.weight`, `components.annotator`, `components.event_time`,
            `components.contribution`, `components.adjusted_value`, `components.lateness_ms`, `components.evidence`,
            `components.imputed`, woven_at, reward_policy_version, rules_fired, imputed)
        SELECT {lid}, {session}, concat({session}, '-ep0'), number % {steps}, 2, 0.5, 'complete',
            'confidence_weighted_mean', concat('pv-', toString(intDiv(number, {steps}) % 3)),
            [concat('rc-', toString(2 * number)), concat('rc-', toString(2 * number + 1))], ['judge', 'human'],
            ['quality', 'quality'], [0.4, 0.6], [1, 1], [1, 1], ['LLM', 'HUMAN'], [{at}, {at}], [0.2, 0.3],
            [0.4, 0.6], [0, 0], [NULL, NULL], [false, number % 20 = 0], {at} + INTERVAL 40 SECOND, 'bench-1', [],
            if(number % 20 = 0, ['human'], [])
        FROM numbers({n})""",
        f"""INSERT INTO late_rewards (event_id, logical_event_id, session_id, episode_id, agent_id, policy_version,
            source, name, value, confidence, annotator, reason, detail, lateness_ms, deadline, event_time,
            reward_policy_version, revision)
        SELECT concat('le-', toString(number)), {lid}, {session}, '', 'judge',
            concat('pv-', toString(intDiv(number, {steps}) % 3)), 'judge', 'quality', 0.1, 1, 'LLM',
            if(number % 3 = 0, 'ORPHAN', 'AFTER_GRACE'), 'bench', 5000, {at}, {at} + INTERVAL 20 SECOND, 'bench-1', 1
        FROM numbers({n}) WHERE number % 20 = 7""",
        f"""INSERT INTO dead_letters (dead_letter_id, stage, reason, topic, partition, offset, key, value, event_id,
            session_id, schema_name, failed_at)
        SELECT concat('rewards/0/', toString(number)), 'VALIDATE', 'confidence must be in [0, 1], got 2.0', 'rewards',
            0, number, {session}, 'x', NULL, {session}, 'treadle.events.RewardSignal', {at}
        FROM numbers({n}) WHERE number % {100 * steps} = 3""",
        f"""INSERT INTO raw_events (kind, schema_name, event_id, session_id, agent_id, episode_id, logical_event_id,
            seq, event_time, policy_version, trace_id, attributes, payload_json, ingested_revision)
        SELECT 'lifecycle', 'treadle.events.LifecycleEvent', concat('lc-', toString(number)),
            concat('bs-', toString(intDiv(number, 2))), 'agent', '', '', number % 2,
            fromUnixTimestamp64Micro(toInt64({BASE_US} + number * 1000000), 'UTC'), '', '', map(),
            if(number % 2 = 0, '{{"kind": "SESSION_CREATED"}}', '{{"kind": "EPISODE_ENDED"}}'), 1
        FROM numbers({2 * sessions}) WHERE number % 2 = 0 OR number % 4 = 1""",
    ]


def serve_sql(home: Path, sessions: int, steps: int) -> None:
    """The child: fill chDB at `home`, then serve the SQL endpoint until killed."""
    from aiohttp import web

    from sinks.clickhouse import ClickHouseStore
    from sinks.migrations import apply_migrations
    from sinks.service import sql_app
    from streams.runtime.run_info import SqlEndpoint
    from topics.settings import Settings

    settings = Settings(home=home, sql_port=PORT)
    store = ClickHouseStore.open(settings)
    apply_migrations(store)
    started = time.perf_counter()
    for statement in fill_sql(sessions, steps):
        store.command_sync(statement)
    print(f"filled {sessions:,} sessions x {steps} steps in {time.perf_counter() - started:.1f} s", flush=True)

    async def main() -> None:
        runner = web.AppRunner(sql_app(store), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", PORT).start()
        SqlEndpoint(pid=os.getpid(), port=PORT).write(settings)
        await asyncio.Event().wait()

    asyncio.run(main())


def pages(steps: int) -> dict[str, str]:
    mid = "bs-4242"
    return {
        "sessions (latest first)": "/sessions",
        "sessions sorted by steps": "/sessions?sort=steps&order=desc",
        "sessions by agent + policy": "/sessions?agent=agent-7&policy=pv-1",
        "sessions, ended, page 200": "/sessions?status=ended&page=200",
        "sessions by dead letters (full join)": "/sessions?sort=dead_letters&order=desc",
        "sessions, search a step id": f"/sessions?q=bl-{4242 * steps + 1}",
        "timeline of one session": f"/sessions/{mid}",
        "step explanation": f"/steps/bl-{4242 * steps + 1}",
        "reward flow": "/rewards",
        "dead letters": "/dead-letters",
    }


def run(sessions: int, steps: int, renders: int) -> None:
    from aiohttp import web

    from topics.settings import Settings
    from treadle.console.app import console_app

    print(machine_facts())
    with tempfile.TemporaryDirectory(prefix="console-bench-") as tmp:
        home = Path(tmp)
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.console_bench", "--serve", str(home), "--sessions", str(sessions),
             "--steps", str(steps)],
            cwd=REPO_ROOT,
        )  # fmt: skip
        try:
            endpoint = home / "worker" / "sql.json"
            deadline = time.monotonic() + 900
            while not endpoint.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the SQL service did not start")
                time.sleep(0.2)
            settings = Settings(home=home, sql_port=PORT)

            async def serve_console() -> web.AppRunner:
                runner = web.AppRunner(console_app(settings), access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", CONSOLE_PORT).start()
                return runner

            loop = asyncio.new_event_loop()
            runner = loop.run_until_complete(serve_console())
            import threading

            threading.Thread(target=loop.run_forever, daemon=True).start()
            print(f"\n{'page':36} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}  (n={renders}, {sessions:,} sessions)")
            times: dict[str, list[float]] = {name: [] for name in pages(steps)}
            for i in range(renders + 1):  # round robin: a burst of load elsewhere hits every page alike
                for name, path in pages(steps).items():
                    started = time.perf_counter()
                    with urllib.request.urlopen(f"http://127.0.0.1:{CONSOLE_PORT}{path}", timeout=120) as response:
                        body = response.read()
                        assert response.status == 200 and b'id="error"' not in body, (path, body[-500:])
                    if i:  # the first round warms caches
                        times[name].append((time.perf_counter() - started) * 1000)
            for name, values in times.items():
                values.sort()
                p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
                print(f"{name:36} {statistics.median(values):8.1f} {p95:8.1f} {values[-1]:8.1f}")
            print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        finally:
            child.terminate()
            child.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=8, help="steps per session")
    parser.add_argument("--renders", type=int, default=20, help="timed requests per page")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve_sql(args.serve, args.sessions, args.steps)
    else:
        run(args.sessions, args.steps, args.renders)


if __name__ == "__main__":
    main()
