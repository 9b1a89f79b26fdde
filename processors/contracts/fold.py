"""Contract checks as a pure fold over a session's state versions (StateVersion records, in ordinal order).

The state graph already orders a session's events and records, per version, what changed; folding those changes
gives the state at every version without a second reorder buffer. An `action` version (a dispatch) is checked
against the preconditions and parameter constraints over the state before it (the version the agent acted on);
a `result` version (a tool result) against the postconditions over the state after it, with the state at the
dispatch as `before`. A tool's effects on the state count for its postconditions when the agent reports them
(StateDeltas) before the tool result, as the seq orders them.

Deterministic: the outcome is a function of the versions and of the contracts effective at the dispatch's
event time, so a replay (or a version published twice, after a crash) gives the same checks; a version at or
below the session's last ordinal is a duplicate and is skipped.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from processors.rewards import reward_signal
from topics.contracts import (
    AUTO_NODE_TYPES,
    Check,
    CompiledContract,
    Contract,
    Outcome,
    Phase,
    WorldCache,
    check_post,
    check_pre,
    effective,
)
from topics.ids import uuid5_text

SOURCE = "contract"  # the RewardSignal source fusion rules match (`match: {source: contract}`)
_MAX_PENDING = 256  # dispatches per session waiting for their result; the oldest is dropped past this
_NAMESPACE = uuid.UUID("5d0c9a52-8a8e-4b1c-9d38-7c1bb0f3e2a4")


@dataclass
class SessionContracts:
    """What the fold keeps per session: the world's nodes at its last version, and the dispatches in flight."""

    ordinal: int = 0
    version: str = ""
    nodes: dict[str, tuple[str, Any]] = field(default_factory=dict)
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)  # step -> dispatch facts for its postconditions
    world: int = 0  # the last ordinal that changed the world's nodes: names their content (WorldCache key)
    changed: dict[str, int] = field(default_factory=dict)  # node id -> the last ordinal that changed it (its mark)

    def to_bytes(self) -> bytes:
        nodes = {k: list(v) for k, v in self.nodes.items()}
        return orjson.dumps({"ordinal": self.ordinal, "version": self.version, "nodes": nodes, "pending": self.pending,
                             "world": self.world, "changed": self.changed})  # fmt: skip

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> SessionContracts:
        if raw is None:
            return cls()
        doc = orjson.loads(raw)
        nodes = {k: (v[0], v[1]) for k, v in doc["nodes"].items()}
        changed = doc.get("changed") or dict.fromkeys(nodes, doc["ordinal"])  # a node as it was at that ordinal
        return cls(doc["ordinal"], doc["version"], nodes, doc["pending"], doc.get("world", doc["ordinal"]), changed)


@dataclass(frozen=True)
class Checked:
    """Checks of one version, with what a record about them needs."""

    version: dict[str, Any]
    phase: Phase
    step: int | None
    tool: str
    state_version_id: str
    checks: list[Check]


class ContractBook:
    """Every known contract version, compiled once; which apply to a tool at an event time."""

    def __init__(self, contracts: Iterable[Contract] = ()) -> None:
        self._compiled: dict[tuple[str, int], CompiledContract] = {}
        self._by_tool: dict[str, list[Contract]] = {}
        self._latest: dict[str, tuple[int, list[CompiledContract]]] = {}  # tool -> (from, contracts then on)
        for contract in contracts:
            self.add(contract)

    def add(self, contract: Contract) -> None:
        key = (contract.name, contract.version)
        if key in self._compiled:
            return
        self._compiled[key] = CompiledContract(contract)
        self._by_tool.setdefault(contract.tool, []).append(contract)
        self._latest.pop(contract.tool, None)

    def __len__(self) -> int:
        return len(self._compiled)

    def for_tool(self, tool: str, at_us: int) -> list[CompiledContract]:
        contracts = self._by_tool.get(tool, ())
        latest = self._latest.get(tool)
        if latest is not None and at_us >= latest[0]:  # every version is in effect: the newest per name
            return latest[1]
        chosen = [self._compiled[(c.name, c.version)] for c in effective(contracts, at_us)]
        last = max((c.effective_from_us for c in contracts), default=None)
        if last is not None and at_us >= last:
            self._latest[tool] = (last, chosen)
        return chosen

    def versions(self, keys: Iterable[tuple[str, int]]) -> list[CompiledContract]:
        return [self._compiled[k] for k in keys if k in self._compiled]


def _node_data(version: dict[str, Any], node_id: str) -> Any:
    for change in version["node_changes"]:
        if change["node_id"] == node_id and change["next"] is not None:
            return orjson.loads(change["next"]["data_json"])
    return None


def apply_changes(session: SessionContracts, version: dict[str, Any]) -> None:
    """The world's nodes after `version` (auto nodes are never kept)."""
    for change in version["node_changes"]:
        nxt = change["next"]
        if nxt is None:
            if session.nodes.pop(change["node_id"], None) is not None:
                session.changed.pop(change["node_id"], None)
                session.world = version["ordinal"]
        elif nxt["type"] not in AUTO_NODE_TYPES:
            session.nodes[change["node_id"]] = (nxt["type"], orjson.loads(nxt["data_json"]))
            session.changed[change["node_id"]] = session.world = version["ordinal"]
    session.ordinal, session.version = version["ordinal"], version["version_id"]


def fold(
    session: SessionContracts, version: dict[str, Any], book: ContractBook, worlds: WorldCache | None = None
) -> Checked | None:
    """Apply one StateVersion; the checks it calls for (None for a duplicate or a version nobody checks). `worlds`
    keeps each session's converted world between checks (the outcome is the same without it)."""
    if version["ordinal"] <= session.ordinal:
        return None
    lid, tool = version["logical_event_id"], version.get("tool") or ""
    if version["kind"] == "action":
        contracts = book.for_tool(tool, version["event_time"])
        if not contracts:
            apply_changes(session, version)
            return None
        before_version = version["parent_id"]
        action = _node_data(version, f"action:{lid}") or {}
        params = action.get("params", {})
        world = (version["session_id"], session.world)
        # the world before it
        checks = check_pre(contracts, before_version, session.nodes, params, worlds, world, session.changed)
        if any(c.post for c in contracts):
            keep = any(c.reads_before for c in contracts)  # else `before` is not worth a copy of the world
            session.pending[lid] = {
                "tool": tool, "params": params, "version": before_version,
                "nodes": {k: list(v) for k, v in session.nodes.items()} if keep else None,
                "contracts": [[c.contract.name, c.contract.version] for c in contracts if c.post],
            }  # fmt: skip
            while len(session.pending) > _MAX_PENDING:
                session.pending.pop(next(iter(session.pending)))
        apply_changes(session, version)
        return Checked(version, Phase.PRE, version.get("step"), tool, before_version, checks)
    apply_changes(session, version)
    if version["kind"] != "result":
        return None
    pending = session.pending.pop(lid, None)
    if pending is None:
        return None  # no dispatch was checked for this step (no contract, or it came before this processor)
    result = _node_data(version, f"result:{lid}") or {}
    contracts = book.versions((name, v) for name, v in pending["contracts"])
    kept = pending["nodes"]
    before = (pending["version"], {k: (t, d) for k, (t, d) in kept.items()}) if kept is not None else None
    world = (version["session_id"], session.world)
    after = (session.version, session.nodes)
    checks = check_post(contracts, before, after, pending["params"], result, worlds, world, session.changed)
    return Checked(version, Phase.POST, version.get("step"), tool, session.version, checks)


def _uuid5(prefix: Any, rest: str) -> str:
    """str(uuid.uuid5(namespace, name)) where `prefix` is a sha1 already fed the namespace and the name's start:
    the same id, without re-hashing the shared part or building UUID objects (it is made per check)."""
    digest = prefix.copy()
    digest.update(rest.encode())
    return uuid5_text(digest.hexdigest())


def _id_prefix(session_id: str, step: str) -> Any:
    return hashlib.sha1(_NAMESPACE.bytes + f"{session_id}\0{step}\0".encode(), usedforsecurity=False)


def check_id(session_id: str, step: str, contract: str, phase: str) -> str:
    """uuid5 of (session, step, contract, phase): a replay's check replaces the first one's."""
    return _uuid5(_id_prefix(session_id, step), f"{contract}\0{phase}")


def check_records(checked: Checked) -> list[dict[str, Any]]:
    """ContractCheck records, one per contract."""
    v = checked.version
    prefix = _id_prefix(v["session_id"], v["logical_event_id"])
    common = {
        "session_id": v["session_id"],
        "episode_id": v["episode_id"],
        "logical_event_id": v["logical_event_id"],
        "step": checked.step,
        "tool": checked.tool,
        "state_version_id": checked.state_version_id,
        "source_event_id": v["event_id"],
        "event_time": v["event_time"],
    }
    phase = checked.phase.value
    values_json: dict[int, str] = {}  # the checks of a phase share one values dict
    records = []
    for c in checked.checks:
        seen = values_json.get(id(c.values))
        if seen is None:
            seen = values_json[id(c.values)] = c.values_json
        records.append({
            **common,
            "check_id": _uuid5(prefix, f"{c.contract}\0{phase}"),
            "contract": c.contract,
            "contract_version": c.version,
            "phase": phase,
            "outcome": c.outcome.value,
            "clause": c.clause,
            "failed_clauses": list(c.failed),
            "reason": c.reason,
            "values_json": seen,
        })  # fmt: skip
    return records


def contract_signal(checked: Checked) -> dict[str, Any] | None:
    """The `contracts` RewardSignal of one phase of a step: -1 when a contract was violated, +1 when all passed,
    none when a clause could not be evaluated and none was violated (nothing is known)."""
    outcomes = [c.outcome for c in checked.checks]
    if not outcomes or (Outcome.VIOLATED not in outcomes and Outcome.NOT_EVALUABLE in outcomes):
        return None
    violated = [c for c in checked.checks if c.outcome is Outcome.VIOLATED]
    value = -1.0 if violated else 1.0
    if violated:
        evidence = "; ".join(f"{c.contract}@v{c.version} {c.phase.value} violated: {c.clause}" for c in violated)
    else:
        evidence = ", ".join(f"{c.contract}@v{c.version}" for c in checked.checks) + f" {checked.phase.value} passed"
    v = checked.version
    judged = {
        "envelope": {
            "event_id": v["event_id"],
            "session_id": v["session_id"],
            "agent_id": SOURCE,
            "episode_id": v["episode_id"],
            "logical_event_id": v["logical_event_id"],
            "seq": v["seq"],
            "event_time": v["event_time"],
            "policy_version": "",
            "trace_id": "",
            "attributes": {},
        }
    }
    return reward_signal(SOURCE, value, judged, name=checked.phase.value, evidence=evidence[:1000])
