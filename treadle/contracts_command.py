"""`treadle contracts register|list|show|available` and `treadle provenance STEP [--verify]`.

Provenance is assembled from what the pipeline stored for the step: the hashes of its dispatch and tool result as
received (step_evidence), the state versions before and after (state_versions), the contract checks
(contract_checks), the reward policy of its latest woven reward, and the executor attributes of its events.
`--verify` rebuilds each event from raw_events (the row mapper's inverse), encodes it again and compares hashes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from topics.settings import Settings
from treadle.cli_errors import friendly
from treadle.reports.query import Query, query_dicts

if TYPE_CHECKING:
    from topics.contracts import Contract

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])

contracts_app = typer.Typer(
    help="Action contracts (pre/postconditions per tool) on the _<prefix>.contracts topic.", no_args_is_help=True
)


class ProvenanceError(LookupError):
    """The step has nothing stored to show (yet)."""


class _NoContracts(Exception):
    """Stands in for ContractError where the CEL engine is not installed (nothing raises it then)."""


def _contract_error() -> type[Exception]:
    try:
        from topics.contracts import ContractError
    except ModuleNotFoundError:  # the CEL engine comes with the worker extra; provenance does without it
        return _NoContracts
    return ContractError


def _one_line(fn: F) -> F:
    """As treadle.cli_errors.friendly, and a refused contract prints each of its reasons."""

    @friendly
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _contract_error() as exc:
            err.print(f"[red]error:[/red] contract {exc.name!r} refused:", highlight=False, soft_wrap=True)
            for reason in exc.reasons:
                err.print(f"  - {reason}", highlight=False, markup=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def registry(s: Settings):
    from topics.catalog import TopicCatalog
    from topics.contract_registry import ContractRegistry

    catalog = TopicCatalog(s)
    return ContractRegistry(s.kafka_bootstrap_servers, catalog["contracts"].name, catalog["node_types"].name)


def _iso(micros: int) -> str:
    return datetime.fromtimestamp(micros / 1_000_000, UTC).isoformat(timespec="seconds")


def effective_from(text: str, now: datetime) -> int:
    """Micros of `--effective-from`: now, +30s (from now), 10m (ago) or an ISO time."""
    from treadle.reports.eval_report import parse_time

    text = text.strip()
    if text.startswith("+"):
        moment = now + (now - parse_time(text[1:], "--effective-from", now))
    else:
        moment = parse_time(text, "--effective-from", now)
    return int(moment.timestamp() * 1_000_000)


@contracts_app.command("register")
@_one_line
def register(
    path: Annotated[Path, typer.Argument(help="A YAML or JSON contract (see docs/contracts.md).")],
    effective: str = typer.Option(
        "+10s",
        "--effective-from",
        help="Event time from which new steps use it: now, +30s (from now), or ISO. "
        "Ignored when the file sets effective_from_us.",
    ),
) -> None:
    """Register the next version of a contract; refused, with every reason, if a clause does not compile, names an
    unknown node type, or narrows the previous version."""
    from topics.contracts import load_contract

    contract = load_contract(path.read_text(), str(path))
    if contract.effective_from_us == 0:
        contract = contract.model_copy(update={"effective_from_us": effective_from(effective, datetime.now(UTC))})
    record = asyncio.run(registry(Settings.from_env()).register(contract))
    if record is None:
        console.print(f"contract {contract.name} is unchanged (this is its latest version)")
        return
    console.print(
        f"registered contract {record.name} version {record.version} for tool {record.tool}, "
        f"effective from {_iso(record.effective_from_us)}"
    )
    if record.effective_from_us < (datetime.now(UTC).timestamp() + 5) * 1_000_000:
        err.print(
            "note: it is effective already; running workers load it within 5 s, so steps dispatched meanwhile are "
            "checked without it, and with it if they are replayed. Register with --effective-from +30s to avoid that.",
            highlight=False,
            soft_wrap=True,
        )


@contracts_app.command("list")
@_one_line
def list_contracts(as_json: bool = typer.Option(False, "--json", help="One JSON object per version.")) -> None:
    """Every registered contract version."""
    contracts = asyncio.run(registry(Settings.from_env()).load())
    if as_json:
        for c in contracts:
            sys.stdout.write(c.to_json().decode() + "\n")
        return
    table = Table(show_header=True, header_style="bold")
    for column in ("contract", "tool", "version", "effective from", "pre", "params", "post"):
        table.add_column(column)
    for c in contracts:
        table.add_row(
            c.name,
            c.tool,
            str(c.version),
            _iso(c.effective_from_us),
            str(len(c.preconditions)),
            str(len(c.params)),
            str(len(c.postconditions)),
        )
    console.print(table)


@contracts_app.command("show")
@_one_line
def show(
    name: Annotated[str, typer.Argument(help="Contract name.")],
    version: int | None = typer.Option(None, "--version", help="A given version (default: the latest)."),
) -> None:
    """One contract version as JSON."""
    versions = [c for c in asyncio.run(registry(Settings.from_env()).load()) if c.name == name]
    chosen = [c for c in versions if version is None or c.version == version]
    if not chosen:
        known = ", ".join(f"v{c.version}" for c in versions) or "none"
        raise ProvenanceError(f"no contract {name!r}" + (f" version {version}" if version else "") + f" ({known})")
    sys.stdout.write(json.dumps(chosen[-1].model_dump(mode="json"), indent=2) + "\n")


def mask(contracts: list[Contract], graph: Any) -> list[str]:
    """available_actions over a StateGraph (treadle.state) with the contracts effective at its time."""
    from topics.contracts import CompiledContract, available_actions, effective

    nodes = {n.id: (n.type, n.data) for n in graph.nodes.values()}
    compiled = [CompiledContract(c) for c in effective(contracts, graph.time or 2**62)]
    return available_actions(compiled, graph.version_id, nodes)


@contracts_app.command("available")
@_one_line
def available(
    session: Annotated[str, typer.Argument(help="Session id.")],
    at: str = typer.Option(None, "--at", help="Version id, ordinal or ISO time (default: now)."),
) -> None:
    """The action mask: tools whose preconditions hold in the session's state at a version (from ClickHouse)."""
    from treadle.state.history import state_at

    s = Settings.from_env()
    graph = state_at(s, session, at or datetime.now(UTC))
    tools = mask(asyncio.run(registry(s).load()), graph)
    sys.stdout.write(json.dumps({"session": session, "version": graph.version_id, "available": tools}) + "\n")


# -- provenance -------------------------------------------------------------------------------------------------------


def fetch_provenance(query: Query, step: str) -> dict[str, Any]:
    """The evidence record of one step (see the module doc); ProvenanceError when nothing is stored for it."""
    from sinks.sql_params import quote

    q = quote(step)
    events = query_dicts(
        query,
        f"""SELECT event_id, schema_name, tool, sha256, size_bytes, attributes, session_id,
        toUnixTimestamp64Micro(event_time) AS event_time_us
        FROM step_evidence_latest WHERE logical_event_id = {q} ORDER BY event_time, event_id""",
    )
    if not events:
        raise ProvenanceError(
            f"no provenance for step {step}: no dispatch or tool result of it has been hashed "
            "(is the contracts processor enabled, and has the sink caught up?)"
        )
    versions = query_dicts(
        query,
        f"""SELECT kind, parent_id, version_id FROM state_versions_latest
        WHERE logical_event_id = {q} AND kind IN ('action', 'result') ORDER BY ordinal""",
    )
    checks = query_dicts(
        query,
        f"""SELECT contract, contract_version, phase, outcome, clause, failed_clauses, reason,
        values_json, state_version_id FROM contract_checks_latest WHERE logical_event_id = {q}
        ORDER BY phase DESC, contract""",
    )
    woven = query_dicts(
        query,
        f"""SELECT revision, reward_policy_version, value, status FROM woven_rewards FINAL
        WHERE logical_event_id = {q} AND variant = 'live' ORDER BY revision DESC LIMIT 1""",
    )
    action = next((v for v in versions if v["kind"] == "action"), None)
    result = next((v for v in versions if v["kind"] == "result"), None)
    executor = {}
    for e in events:
        executor.update(dict(e["attributes"] or {}))
    return {
        "step": step,
        "session_id": events[0]["session_id"],
        "events": [
            {
                "event_id": e["event_id"],
                "schema_name": e["schema_name"],
                "tool": e["tool"],
                "sha256": e["sha256"],
                "size_bytes": int(e["size_bytes"]),
            }
            for e in events
        ],
        "state_before": action["parent_id"] if action else None,
        "state_after": result["version_id"] if result else None,
        "contracts": [
            {
                **{k: v for k, v in c.items() if k != "values_json"},
                "contract_version": int(c["contract_version"]),
                "failed_clauses": list(c["failed_clauses"]),
                "values": json.loads(c["values_json"]),
            }
            for c in checks
        ],
        "reward_policy_version": woven[0]["reward_policy_version"] if woven else None,
        "reward": {"revision": int(woven[0]["revision"]), "value": woven[0]["value"], "status": woven[0]["status"]}
        if woven
        else None,
        "executor": executor,
    }


def verify(query: Query, evidence: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each hashed event against raw_events: the stored event rebuilt, encoded again and hashed."""
    from sinks.sql_params import quote
    from sinks.variants import event_from_row
    from topics.codec import AvroCodec

    codec = AvroCodec()
    ids = ", ".join(quote(e["event_id"]) for e in evidence["events"])
    stored = {
        r["event_id"]: r
        for r in query_dicts(
            query,
            f"""SELECT e.kind, e.event_id, e.session_id, e.agent_id,
        e.episode_id, e.logical_event_id, e.seq, toUnixTimestamp64Micro(e.event_time) AS event_time_us,
        e.policy_version, e.trace_id, e.attributes, e.payload_json FROM raw_events_latest AS e
        WHERE e.session_id = {quote(evidence["session_id"])} AND e.event_id IN ({ids})""",
        )
    }
    out = []
    for e in evidence["events"]:
        row = stored.get(e["event_id"])
        if row is None:
            out.append({"event_id": e["event_id"], "ok": False, "detail": "not in raw_events"})
            continue
        schema_name, record = event_from_row(row)
        try:
            recomputed = hashlib.sha256(codec.encode_fastavro(schema_name, record)).hexdigest()
        except Exception as exc:  # a stored row that no longer encodes was changed too
            out.append({"event_id": e["event_id"], "ok": False, "detail": f"stored event does not encode: {exc}"})
            continue
        ok = recomputed == e["sha256"]
        out.append(
            {
                "event_id": e["event_id"],
                "ok": ok,
                "recomputed": recomputed,
                "detail": "matches"
                if ok
                else f"differs: hashed {e['sha256'][:16]}…, stored event gives {recomputed[:16]}…",
            }
        )
    return out


def provenance_command(
    step: Annotated[str, typer.Argument(help="The step (logical_event_id).")],
    check: bool = typer.Option(False, "--verify", help="Recompute the hashes from raw_events; exit 1 if any differs."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """A step's evidence: hashes of its dispatch and result as received, state versions before and after, contract
    checks, reward policy version and executor attributes; --verify recomputes the hashes from the stored events."""
    from functools import partial

    from sinks.sql_client import run_sql

    query = partial(run_sql, Settings.from_env())
    evidence = fetch_provenance(query, step)
    if check:
        evidence["verify"] = verify(query, evidence)
    if as_json:
        sys.stdout.write(json.dumps(evidence, default=str) + "\n")
    else:
        _render(evidence)
    if check and not all(v["ok"] for v in evidence["verify"]):
        raise typer.Exit(1)


def _render(e: Mapping[str, Any]) -> None:
    console.print(f"step {e['step']} (session {e['session_id']})", highlight=False)
    console.print(f"  state: {e['state_before'] or '-'} -> {e['state_after'] or '-'}", highlight=False)
    console.print(
        f"  reward policy: {e['reward_policy_version'] or '-'}   executor: {json.dumps(e['executor'], sort_keys=True)}",
        highlight=False,
        markup=False,
    )
    for ev in e["events"]:
        console.print(
            f"  {ev['schema_name'].rsplit('.', 1)[-1]:<16} {ev['event_id']}  sha256 {ev['sha256']}"
            f"  ({ev['size_bytes']} bytes)",
            highlight=False,
        )
    for c in e["contracts"]:
        what = f" {c['clause']}" if c["clause"] else ""
        console.print(
            f"  contract {c['contract']}@v{c['contract_version']} {c['phase']}: {c['outcome']}{what}",
            highlight=False,
            markup=False,
        )
    for v in e.get("verify", []):
        mark = "ok" if v["ok"] else "TAMPERED"
        console.print(f"  verify {v['event_id']}: {mark} ({v['detail']})", highlight=False, markup=False)


provenance = _one_line(provenance_command)
