"""The `treadle` command line. A user mistake prints one readable line and exits 1, never a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from topics.settings import Settings
from treadle.cli_errors import UserError, friendly

if TYPE_CHECKING:
    from processors.steps.policy import RewardPolicy

app = typer.Typer(help="treadle: the data plane for agentic RL.", no_args_is_help=True, add_completion=False)
console = Console()
err = Console(stderr=True)


def settings() -> Settings:
    return Settings.from_env()


@app.command()
@friendly
def up(
    brokers: int = typer.Option(
        0, help="Local Kafka brokers: 1, or 3 for a KRaft cluster (replication 3, 2 in sync); TREADLE_KAFKA_BROKERS."
    ),
) -> None:
    """Start the local stack: Kafka (KRaft) and Valkey; create topics and register schemas."""
    from streams.runtime.worker import prepare_cluster
    from treadle.devstack.stack import LocalStack

    s = Settings.from_env(kafka_brokers=brokers) if brokers else settings()
    with console.status("starting Kafka and Valkey (the first run downloads Kafka's jars)…"):
        status = LocalStack(s).up()
    _print_status(status)
    with console.status("creating topics and registering schemas…"):
        asyncio.run(prepare_cluster(s))
    console.print(f"topics ready ({s.partitions} partitions each); ClickHouse: {_clickhouse_target(s)}")
    if s.kafka_brokers > 1 and s.local_kafka:
        console.print(
            f"{s.kafka_brokers} brokers, {s.replication_factor} replicas per topic: export TREADLE_KAFKA_BROKERS="
            f"{s.kafka_brokers} for the worker and the SDK"
        )


def _clickhouse_target(s: Settings) -> str:
    return f"chDB at {s.chdb_path}" if s.embedded_clickhouse else str(s.clickhouse_url)


@app.command()
@friendly
def down() -> None:
    """Stop the local stack (only processes treadle started)."""
    from treadle.devstack.stack import LocalStack

    _print_status(LocalStack(settings()).down())


@app.command()
@friendly
def status() -> None:
    """Show the local stack and whether a worker is running."""
    from streams.runtime.run_info import WorkerInfo
    from treadle.devstack.stack import LocalStack

    s = settings()
    _print_status(LocalStack(s).status())
    from streams.runtime.run_info import SqlEndpoint

    info = WorkerInfo.read(s)
    where = f"running, pid {info.pid}, http://127.0.0.1:{info.web_port}" if info else "not running"
    console.print(f"worker: {where}")
    endpoint = SqlEndpoint.read(s)
    sink_state = f"running, pid {endpoint.pid}, SQL on 127.0.0.1:{endpoint.port}" if endpoint else "not running"
    console.print(f"sink: {sink_state}")


def _print_status(status: Any) -> None:
    table = Table(show_header=True, header_style="bold")
    for column in ("service", "state", "address", "detail"):
        table.add_column(column)
    for service in status.services:
        state = "running" if service.running else ("external" if not service.managed else "stopped")
        table.add_row(service.name, state, service.address, service.detail)
    console.print(table)


@app.command()
@friendly
def worker(loglevel: str = typer.Option("info", help="Log level: debug, info, warning.")) -> None:
    """Run a worker: step assembly, the ClickHouse sink and the SQL endpoint for `treadle sql`."""
    from sinks.sql_auth import check_sql_bind
    from streams.runtime.worker import run_worker

    s = settings()
    if s.sink == "child" and s.embedded_clickhouse:
        check_sql_bind(s)  # before the worker starts, not in the child's log after it did
    run_worker(s, loglevel=loglevel)


@app.command()
@friendly
def sink(
    parent: int = typer.Option(0, help="Stop when this worker PID is gone (set by `treadle worker`)."),
) -> None:
    """Run the ClickHouse sink and the read-only SQL endpoint (the worker starts one by default)."""
    from sinks.service import run_sink

    logging.getLogger().setLevel(logging.INFO)
    run_sink(settings(), parent_pid=parent or None)


# A query may start with a `-- comment`: click would read it as an unknown option, so unknown options are
# taken as the argument (`treadle sql -- "…"` and `-` for stdin work too).
@app.command(context_settings={"ignore_unknown_options": True})
@friendly
def sql(
    query: str = typer.Argument(
        ..., help="One read-only statement: SELECT, WITH, SHOW, DESCRIBE, EXPLAIN; `-` reads it from stdin."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print rows as JSON lines."),
) -> None:
    """Query the ClickHouse tables (through the running worker when it owns the embedded chDB)."""
    from sinks.sql_client import run_sql

    columns, rows = run_sql(settings(), sys.stdin.read() if query == "-" else query)
    if as_json:
        for row in rows:
            sys.stdout.write(json.dumps(dict(zip(columns, row, strict=True)), default=str) + "\n")
        return
    table = Table(show_header=True, header_style="bold")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[_cell(v) for v in row])
    console.print(table)
    console.print(f"{len(rows)} row(s)")


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "…"


@app.command()
@friendly
def explain(
    logical_event_id: str = typer.Argument(..., help="The step whose reward to explain."),
    revision: int | None = typer.Option(None, "--revision", help="An older revision of the woven reward."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Why a step got its reward: components, weights, contributions, rules fired, conflicts, imputed parts."""
    from functools import partial

    from sinks.sql_client import run_sql
    from treadle.reports.explain import ExplainError, fetch_explanation, render

    try:
        explanation = fetch_explanation(partial(run_sql, settings()), logical_event_id, revision)
    except ExplainError as exc:
        raise UserError(str(exc)) from None
    if as_json:
        sys.stdout.write(json.dumps(explanation.as_json(), default=str) + "\n")
    else:
        render(explanation, console)


@app.command()
@friendly
def topics() -> None:
    """List the topic catalog and what the broker has."""
    from topics.catalog import TopicCatalog

    s = settings()
    states = asyncio.run(_topic_states(s))
    table = Table(show_header=True, header_style="bold")
    for column in ("topic", "role", "partitions", "key", "value schema", "cleanup/retention", "on broker"):
        table.add_column(column)
    for spec in TopicCatalog(s):
        found = states.get(spec.name)
        table.add_row(
            spec.name,
            str(spec.role),
            str(spec.partitions),
            spec.key,
            spec.value_schema or "JSON",
            f"{spec.config.get('cleanup.policy')}/{spec.config.get('retention.ms')}",
            "missing" if found is None else f"{found} partitions",
        )
    console.print(table)


@app.command()
@friendly
def processors(as_json: bool = typer.Option(False, "--json", help="Print one JSON object per processor.")) -> None:
    """List the processor plugins (entry points `treadle.processors`) and which ones TREADLE_PROCESSORS enables;
    exits 1 if a plugin does not load or TREADLE_PROCESSORS names one that is not installed."""
    from streams.runtime.plugins import ENTRY_POINT_GROUP, REINSTALL_HINT, ProcessorRegistry

    wanted = settings().processors
    registry = ProcessorRegistry.discover()
    infos, errors = registry.describe()
    if as_json:
        for info in infos:
            sys.stdout.write(json.dumps({**info.to_json(), "enabled": info.name in wanted}) + "\n")
    else:
        console.print(_processor_table(infos, set(wanted)))
    for error in errors:
        err.print(f"[red]error:[/red] {error}", highlight=False, soft_wrap=True)
    missing = registry.missing(wanted)
    if missing:
        err.print(f"[red]error:[/red] TREADLE_PROCESSORS names {', '.join(missing)}, which no installed package "
                  f"provides (entry point group {ENTRY_POINT_GROUP}). {REINSTALL_HINT}", highlight=False,
                  soft_wrap=True)  # fmt: skip
    if errors or missing:
        raise typer.Exit(1)


def _processor_table(infos: list[Any], enabled: set[str]) -> Table:
    """Fits 80 columns: the doc wraps, inputs are short names; module and version are in --json."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1), pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("on", no_wrap=True)
    table.add_column("inputs", no_wrap=True)
    table.add_column("doc", ratio=1, min_width=20)
    for info in infos:
        inputs = "\n".join(i.rsplit(".", 1)[-1] for i in info.inputs)
        table.add_row(info.name, str(info.kind), "yes" if info.name in enabled else "", inputs, info.doc)
    return table


plugin_app = typer.Typer(help="Processor plugins: make a new one.", no_args_is_help=True)
app.add_typer(plugin_app, name="plugin")


@plugin_app.command("new")
@friendly
def plugin_new(
    name: str = typer.Argument(..., help="The plugin's name: module, entry point and TREADLE_PROCESSORS entry."),
    kind: str = typer.Option("reward-source", "--kind", help="reward-source, evaluator or processor."),
    folder: Annotated[Path | None, typer.Option("--dir", help="Folder to write it in (default: ./NAME).")] = None,
) -> None:
    """Write a complete, installable plugin package (pyproject, src/ module, README, unit test) and print the
    commands that install it, enable it and show its rows."""
    from treadle.plugin_scaffold import PluginKind, ScaffoldError, new_plugin

    try:
        chosen = PluginKind(kind)
    except ValueError:
        raise UserError(f"--kind {kind!r}: expected one of {', '.join(PluginKind)}") from None
    try:
        made = new_plugin(name, chosen, folder or Path(name), enabled=settings().processors)
    except ScaffoldError as exc:
        raise UserError(str(exc)) from None
    console.print(f"wrote {chosen} plugin {name!r} in {made.folder}/ (its unit test: pytest {made.folder})",
                  highlight=False, soft_wrap=True)  # fmt: skip
    for command in made.commands:
        sys.stdout.write(f"  {command}\n")


async def _topic_states(s: Settings) -> dict[str, int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap_servers, request_timeout_ms=5000)
    await admin.start()
    try:
        names = await admin.list_topics()
        described = await admin.describe_topics([n for n in names if n.startswith((s.topic_prefix, "_"))])
        return {d["topic"]: len(d["partitions"]) for d in described}
    finally:
        await admin.close()


schemas_app = typer.Typer(help="The schema registry on the _<prefix>.schemas topic.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")


@schemas_app.command("list")
@friendly
def schemas_list() -> None:
    """Registered subjects and their versions."""
    registry = _registry(settings())
    asyncio.run(registry.load())
    table = Table(show_header=True, header_style="bold")
    for column in ("subject", "version", "fingerprint"):
        table.add_column(column)
    for subject in registry.versions.subjects():
        for version in registry.versions.versions(subject):
            table.add_row(subject, str(version.version), f"{version.schema.fingerprint:016x}")
    console.print(table)


@schemas_app.command("register")
@friendly
def schemas_register(
    path: Annotated[Path, typer.Argument(help="An .avsc file; named types it uses are read from its folder.")],
) -> None:
    """Register a new version of a record schema; refused, with the reasons, if it breaks compatibility."""
    from fastavro.schema import SchemaParseException

    from topics.schemas import AvroSchema

    try:
        schema = AvroSchema.from_file(path)
    except (OSError, ValueError, SchemaParseException) as exc:
        raise UserError(f"cannot read an Avro schema from {path}: {exc}") from None
    registered = asyncio.run(_registry(settings()).register([schema]))
    if registered:
        console.print(f"registered {schema.name} version {registered[0].version} ({schema.fingerprint:016x})")
    else:
        console.print(f"{schema.name} ({schema.fingerprint:016x}) was already registered")


node_types_app = typer.Typer(
    help="State-graph node types: a JSON Schema per type, on the _<prefix>.node_types topic.", no_args_is_help=True
)
app.add_typer(node_types_app, name="node-types")


@node_types_app.command("register")
@friendly
def node_types_register(
    node_type: Annotated[str, typer.Argument(help="The node type, as deltas name it (e.g. memory).")],
    path: Annotated[Path, typer.Argument(help="A JSON Schema file for the node's data.")],
) -> None:
    """Register a new version of a node type; a change that would invalidate existing nodes is refused, with a diff."""
    from jsonschema.exceptions import SchemaError

    from topics.node_types import IncompatibleNodeTypeError

    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read a JSON Schema from {path}: {exc}") from None
    if not isinstance(schema, dict):
        raise UserError(f"{path} holds a JSON {type(schema).__name__}, not a JSON Schema object")
    try:
        record = asyncio.run(_node_types(settings()).register(node_type, schema))
    except SchemaError as exc:
        raise UserError(f"{path} is not a valid JSON Schema: {exc.message}") from None
    except IncompatibleNodeTypeError as exc:
        err.print(
            f"[red]error:[/red] node type {node_type!r}: breaking change refused: {'; '.join(exc.reasons)}",
            highlight=False,
            soft_wrap=True,
        )
        err.print(exc.diff, highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if record is None:
        console.print(f"node type {node_type} is unchanged (this schema is its latest version)")
    else:
        console.print(f"registered node type {node_type} version {record.version}")


@node_types_app.command("list")
@friendly
def node_types_list(
    as_json: bool = typer.Option(False, "--json", help="Print each type's latest schema as JSON."),
) -> None:
    """Registered node types, their latest version and the properties they declare."""
    types = asyncio.run(_node_types(settings()).load())
    latest = [t for name in types.types() if (t := types.latest(name)) is not None]
    if as_json:
        for t in latest:
            sys.stdout.write(json.dumps({"node_type": t.node_type, "version": t.version, "schema": t.schema}) + "\n")
        return
    table = Table(show_header=True, header_style="bold")
    for column in ("node type", "version", "required", "properties"):
        table.add_column(column)
    for t in latest:
        required = ", ".join(t.schema.get("required", [])) or "-"
        table.add_row(t.node_type, str(t.version), required, ", ".join(sorted(t.schema.get("properties", {}))) or "-")
    console.print(table)


def _node_types(s: Settings):
    from topics.catalog import TopicCatalog
    from topics.node_types import NodeTypeRegistry

    return NodeTypeRegistry(s.kafka_bootstrap_servers, TopicCatalog(s)["node_types"].name)


policy_app = typer.Typer(help="Reward policies (specs per reward source) on the _<prefix>.reward_policies topic.",
                         no_args_is_help=True)  # fmt: skip
app.add_typer(policy_app, name="policy")


@policy_app.command("push")
@friendly
def policy_push(
    path: Annotated[Path, typer.Argument(help="A JSON or YAML reward policy (see docs/reward-weaving.md).")],
    effective_from: str = typer.Option(
        "+10s",
        help="Event time from which new steps use it: now, +30s (from now), or an ISO time. "
        "Ignored when the file sets effective_from_us.",
    ),
) -> None:
    """Publish a reward policy version; workers pick it up within seconds, for steps dispatched after it."""
    from processors.steps.policy import load_policy_file
    from processors.steps.policy_topic import PolicyTopic

    policy = effective_policy(load_policy_file(path), effective_from, datetime.now(UTC))
    s = settings()
    topic = PolicyTopic(s.kafka_bootstrap_servers, _catalog(s)["reward_policies"].name)
    if asyncio.run(topic.push(policy)):
        console.print(f"pushed reward policy {policy.version}, effective from {_micros_iso(policy.effective_from_us)}")
    else:
        console.print(f"reward policy {policy.version} was already pushed with this content")


def effective_policy(policy: RewardPolicy, text: str, now: datetime) -> RewardPolicy:
    """The policy `treadle policy push` publishes: effective from `--effective-from` (now, +30s from now, 30m ago or
    an ISO time) unless its file sets effective_from_us."""
    from treadle.reports.eval_report import parse_time

    if policy.effective_from_us != 0:
        return policy
    text = text.strip()
    if text.startswith("+"):  # a duration from now, into the future
        moment = now + (now - parse_time(text[1:], "--effective-from", now))
    else:
        moment = parse_time(text, "--effective-from", now)
    return policy.model_copy(update={"effective_from_us": int(moment.timestamp() * 1_000_000)})


@policy_app.command("list")
@friendly
def policy_list(as_json: bool = typer.Option(False, "--json", help="Print the policies as JSON.")) -> None:
    """Every pushed reward policy version, oldest first."""
    from processors.steps.policy_topic import PolicyTopic

    s = settings()
    policies = asyncio.run(PolicyTopic(s.kafka_bootstrap_servers, _catalog(s)["reward_policies"].name).load())
    policies.sort(key=lambda p: (p.effective_from_us, p.version))
    if as_json:
        console.print_json(json.dumps([p.model_dump(mode="json") for p in policies]))
        return
    table = Table(show_header=True, header_style="bold")
    for column in ("version", "effective from", "specs", "required", "fusion rules"):
        table.add_column(column)
    for p in policies:
        required = ", ".join(spec.key for spec in p.required) or "-"
        rules = str(len(p.fusion.rules))
        table.add_row(p.version, _micros_iso(p.effective_from_us), str(len(p.specs)), required, rules)
    console.print(table)


def _micros_iso(micros: int) -> str:
    return datetime.fromtimestamp(micros / 1_000_000, UTC).isoformat(timespec="seconds")


def _catalog(s: Settings):
    from topics.catalog import TopicCatalog

    return TopicCatalog(s)


def _registry(s: Settings):
    from topics.catalog import TopicCatalog
    from topics.registry import SchemaRegistry

    return SchemaRegistry(s.kafka_bootstrap_servers, TopicCatalog(s)["schemas"].name)


@app.command()
@friendly
def demo(
    sessions: int = typer.Option(20, help="Simulated agent sessions."),
    steps: int = typer.Option(10, help="Steps per session."),
    seed: int = typer.Option(7, help="Random seed."),
    timeout: float = typer.Option(120.0, help="Seconds to wait for the replay table to fill."),
) -> None:
    """Run simulated agents and reward sources through the whole pipeline, then show replay rows."""
    from treadle.demo import run_demo

    run_demo(settings(), sessions=sessions, steps=steps, seed=seed, timeout=timeout, console=console)


@app.command("eval")
@friendly
def eval_report(
    since: str | None = typer.Option(None, help="Start (inclusive): ISO time, or a duration ago like 24h, 7d."),
    until: str | None = typer.Option(None, help="End (exclusive): ISO time, or a duration ago; default now."),
    policy_version: Annotated[
        list[str] | None, typer.Option("--policy-version", help="Only this policy version (repeatable).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for the PNG charts (default: TREADLE_HOME/eval).")] = None,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
) -> None:
    """Evaluation report: tool success and latency, episode return/success/cost, safety, preference win rate."""
    from functools import partial

    from sinks.sql_client import run_sql
    from treadle.reports.eval_charts import write_charts
    from treadle.reports.eval_report import ReportError, build_report, filters_from_options, render

    s = settings()
    try:
        report = build_report(partial(run_sql, s), filters_from_options(since, until, policy_version or []))
    except ReportError as exc:
        raise UserError(str(exc)) from None
    report.charts = [str(path) for path in write_charts(report, out or s.home / "eval")]
    if as_json:
        sys.stdout.write(json.dumps(report.as_json(), default=str) + "\n")
    else:
        render(report, console)


@app.command("export")
@friendly
def export_command(
    output: Annotated[Path | None, typer.Argument(help="File to write (default with --manifest: its output).")] = None,
    shape: str = typer.Option("transitions", "--shape", help="transitions, trajectories or triplets."),
    fmt: str = typer.Option("parquet", "--format", help="parquet, arrow (IPC file) or jsonl."),
    since: str | None = typer.Option(None, help="Steps dispatched from: ISO time, or a duration ago like 24h, 7d."),
    until: str | None = typer.Option(None, help="Steps dispatched before: ISO time or duration ago; default now."),
    policy_version: Annotated[
        list[str] | None, typer.Option("--policy-version", help="Only this policy version (repeatable).")
    ] = None,
    agent: Annotated[list[str] | None, typer.Option("--agent", help="Only this agent id (repeatable).")] = None,
    session: Annotated[list[str] | None, typer.Option("--session", help="Only this session (repeatable).")] = None,
    episode: Annotated[list[str] | None, typer.Option("--episode", help="Only this episode (repeatable).")] = None,
    settled: bool = typer.Option(False, "--settled", help="Only steps whose required reward windows all closed."),
    status: Annotated[
        list[str] | None, typer.Option("--status", help="Only this reward status, e.g. complete (repeatable).")
    ] = None,
    min_confidence: float | None = typer.Option(None, help="Only steps whose reward components are this confident."),
    batch_rows: int | None = typer.Option(None, help="Rows per page and record batch (memory per page)."),
    variant: str = typer.Option("live", help="Whose rows: live (the worker's) or a `treadle reweave --as` name."),
    manifest: Annotated[Path | None, typer.Option(help="Re-run the export this manifest describes.")] = None,
    force: bool = typer.Option(False, "--force", help="Overwrite the output if it exists."),
) -> None:
    """Export replay rows for training (Parquet, Arrow IPC or JSON lines) with a manifest that reproduces them."""
    from treadle.export_command import run_export

    run_export(
        settings(),
        console,
        output=output,
        shape=shape,
        fmt=fmt,
        since=since,
        until=until,
        policy_versions=policy_version or [],
        agents=agent or [],
        sessions=session or [],
        episodes=episode or [],
        settled=settled,
        statuses=status or [],
        min_confidence=min_confidence,
        batch_rows=batch_rows,
        variant=variant,
        manifest=manifest,
        force=force,
    )


@app.command("reweave")
@friendly
def reweave_command(
    policy: Annotated[Path, typer.Option("--policy", help="Reward policy file (JSON or YAML) to weave the past with.")],
    as_name: str = typer.Option(..., "--as", help="Variant name the rows are written under (not live)."),
    since: str | None = typer.Option(None, "--from", help="Steps dispatched from: ISO time, or a duration ago (7d)."),
    until: str | None = typer.Option(None, "--to", help="Steps dispatched before: ISO time or a duration ago."),
) -> None:
    """Re-weave past steps under another reward policy into a variant, beside the live rows (never changing them)."""
    from processors.steps.policy import load_policy_file
    from treadle.reweave import reweave_history

    start, end = _time_range(since, until)
    report = reweave_history(settings(), load_policy_file(policy), as_name, start, end)
    console.print(report.summary(), highlight=False, soft_wrap=True)


@app.command("backfill")
@friendly
def backfill_command(
    processor: str = typer.Option(..., "--processor", help="The reward-source plugin to run over past events."),
    as_name: str = typer.Option(..., "--as", help="Variant name the rows are written under (not live)."),
    since: str | None = typer.Option(None, "--from", help="Steps dispatched from: ISO time, or a duration ago (7d)."),
    until: str | None = typer.Option(None, "--to", help="Steps dispatched before: ISO time or a duration ago."),
    policy: Annotated[Path | None, typer.Option("--policy", help="Reward policy file; default: the worker's.")] = None,
) -> None:
    """Run a reward-source plugin over past events and re-weave their steps with its signals into a variant."""
    from processors.steps.policy import load_policy_file
    from treadle.reweave import backfill

    start, end = _time_range(since, until)
    chosen = load_policy_file(policy) if policy is not None else None
    report = backfill(settings(), processor, as_name, start, end, policy=chosen)
    console.print(report.summary(), highlight=False, soft_wrap=True)


def _time_range(since: str | None, until: str | None) -> tuple[datetime | None, datetime | None]:
    from treadle.reports.eval_report import parse_time

    now = datetime.now(UTC)
    return (
        None if since is None else parse_time(since, "--from", now),
        None if until is None else parse_time(until, "--to", now),
    )


@app.command()
@friendly
def state(
    session: str = typer.Argument(..., help="Session id."),
    at: str = typer.Option(None, "--at", help="Version id, ordinal, or ISO time (default: now)."),
    diff: str = typer.Option(None, "--diff", help="Show what changed between two versions: V1..V2."),
    as_json: bool = typer.Option(False, "--json", help="Print the graph (or diff) as JSON."),
) -> None:
    """Show a session's state graph at a version or time, or the diff between two versions."""
    from treadle.reports.state_view import run_state_command
    from treadle.state.history import StateNotFoundError

    try:
        run_state_command(settings(), session, at, diff, as_json, console)
    except (ValueError, StateNotFoundError) as exc:
        raise UserError(str(exc)) from None


@app.command("console")
@friendly
def console_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs a token."),
    port: int = typer.Option(None, "--port", help="Port (default TREADLE_CONSOLE_PORT)."),
) -> None:
    """Serve the read-only debug console: sessions, step timelines, state, reward flow, dead letters, validator."""
    from treadle.console.auth import UnsafeBindError
    from treadle.console.server import run_console

    s = settings()
    logging.getLogger("treadle.console").setLevel(logging.WARNING)
    try:
        run_console(s, host, port or s.console_port)
    except UnsafeBindError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot serve the console on {host}:{port or s.console_port}: {exc.strerror}") from None


@app.command("otlp")
@friendly
def otlp_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (anyone who reaches it can send events)."),
    port: int = typer.Option(None, "--port", help="Port (default TREADLE_OTLP_PORT, 4318)."),
) -> None:
    """Receive OpenTelemetry traces (OTLP/HTTP, POST /v1/traces) and turn GenAI spans into treadle events."""
    try:
        from streams.otlp.receiver import run_otlp
    except ImportError as exc:
        raise UserError(f"`treadle otlp` needs the otlp extra: pip install 'treadle[otlp]' ({exc})") from None
    s = settings()
    logging.getLogger("streams.otlp").setLevel(logging.WARNING)
    try:
        run_otlp(s, host, port or s.otlp_port)
    except OSError as exc:
        raise UserError(f"cannot serve OTLP on {host}:{port or s.otlp_port}: {exc.strerror}") from None


def _contracts_commands() -> None:
    """`treadle contracts ...` and `treadle provenance` (treadle.contracts_command)."""
    from treadle.contracts_command import contracts_app, provenance

    app.add_typer(contracts_app, name="contracts")
    app.command("provenance")(provenance)


_contracts_commands()


def _plan_commands() -> None:
    """`treadle plan show` (treadle.plan_command)."""
    from treadle.plan_command import plan_app

    app.add_typer(plan_app, name="plan")


_plan_commands()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
