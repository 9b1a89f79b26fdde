"""Action contracts as data: preconditions, parameter constraints and postconditions in CEL, and their evaluation.

A contract names a tool and holds three lists of clauses, each a CEL expression (the cel-rust engine, through its
`common-expression-language` binding; never Python eval) that must evaluate to a bool:

- `preconditions` see `state` (the session's state graph at the dispatch: the version the agent acted on);
- `params` (parameter constraints) see `state` and `params` (the dispatch's parameters);
- `postconditions` see `before` (the state at the dispatch), `state` (the state at the tool result), `params`
  and `result` (the tool result: status, output, error, latency_ms, and `json`, the output parsed as JSON or null).

The state views hold the world the agent reasons about: `{"version": id, "nodes": {node id: {"id", "type",
"data"}}}`, without the state graph's own per-step nodes (types `action` and `tool_result`).

This module is pure: compiling, binding the views and evaluating are functions of their arguments, so a replay
evaluates to the same outcome (comprehension macros iterate a map's keys sorted: see engine_source). Registration
(the topic, node types) lives in the contract registry module.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import cel
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from topics.model_errors import field_errors

AUTO_NODE_TYPES = frozenset({"action", "tool_result"})  # the state graph's per-step nodes, left out of the views
_MAX_SEEN_CHARS = 400  # how much of a tool output a check row keeps among the values it saw

PHASE_VARIABLES: Mapping[str, frozenset[str]] = {
    "preconditions": frozenset({"state"}),
    "params": frozenset({"state", "params"}),
    "postconditions": frozenset({"state", "before", "params", "result"}),
}
_ALL_VARIABLES = frozenset().union(*PHASE_VARIABLES.values())
_TYPE_LITERAL = re.compile(r"""\.type\s*==\s*["']([^"']+)["']|["']([^"']+)["']\s*==\s*[\w.\[\]"']*\.type\b""")


class Phase(StrEnum):
    PRE = "pre"  # preconditions and parameter constraints, at the dispatch
    POST = "post"  # postconditions, at the tool result


class Outcome(StrEnum):
    PASSED = "passed"
    VIOLATED = "violated"
    NOT_EVALUABLE = "not_evaluable"  # a clause raised (a missing key, a wrong type) or gave no bool


class ContractError(ValueError):
    """A contract that cannot be registered or used; `reasons` lists every problem found."""

    def __init__(self, name: str, reasons: Sequence[str]) -> None:
        self.name, self.reasons = name, list(reasons)
        super().__init__(f"contract {name!r} refused: " + "; ".join(self.reasons))


class Clause(BaseModel):
    """One named CEL expression that must be true."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="What the clause says, shown in check rows and explanations.")
    expr: str = Field(min_length=1, description="A CEL expression that evaluates to a bool.")


class Contract(BaseModel):
    """One version of a contract: what must hold before, during and after a tool call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="", description="The contract's name (default: the tool); several may cover a tool.")
    tool: str = Field(min_length=1, description="The tool (ActionDispatched.tool) the contract covers.")
    version: int = Field(default=0, ge=0, description="Assigned at registration: 1, 2, ... per name.")
    effective_from_us: int = Field(default=0, description="Steps dispatched at or after this event time use it.")
    description: str = ""
    node_types: tuple[str, ...] = Field(default=(), description="Node types the clauses read (must be registered).")
    preconditions: tuple[Clause, ...] = ()
    params: tuple[Clause, ...] = ()
    postconditions: tuple[Clause, ...] = ()

    @field_validator("preconditions", "params", "postconditions", mode="before")
    @classmethod
    def _clauses(cls, value: Any) -> Any:
        """A clause may be written as a bare expression (its own name) or as {name: expr}."""
        if not isinstance(value, list | tuple):
            return value
        out = []
        for item in value:
            if isinstance(item, str):
                out.append({"name": item, "expr": item})
            elif isinstance(item, dict) and len(item) == 1 and "expr" not in item:
                [(name, expr)] = item.items()
                out.append({"name": name, "expr": expr})
            else:
                out.append(item)
        return out

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("name") and data.get("tool"):
            data = {**data, "name": data["tool"]}
        return data

    @model_validator(mode="after")
    def _unique_clauses(self) -> Contract:
        names = [c.name for c in self.clauses()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"contract {self.name}: clause name(s) used twice: {', '.join(repeated)}")
        return self

    def clauses(self) -> list[Clause]:
        return [*self.preconditions, *self.params, *self.postconditions]

    @property
    def label(self) -> str:
        return f"{self.name}@v{self.version}"

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def load_contract(text: str, source: str = "<contract>") -> Contract:
    """A contract from YAML or JSON text; ContractError with the reason when it is not one."""
    import yaml  # YAML is a superset of JSON

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ContractError(source, [f"not YAML or JSON: {exc}"]) from None
    if not isinstance(doc, dict):
        raise ContractError(source, [f"holds a {type(doc).__name__}, not a mapping"])
    try:
        return Contract.model_validate(doc)
    except ValidationError as exc:
        raise ContractError(str(doc.get("name") or doc.get("tool") or source), field_errors(exc, "<root>")) from None


# -- compiling --------------------------------------------------------------------------------------------------------

_MACRO_CALL = re.compile(r"\.\s*(all|exists_one|exists|map|filter)\s*\(")
_MACRO_BOUND = re.compile(r"\.\s*(?:all|exists_one|exists|map|filter)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,")
_SELECT = re.compile(r"\.\s*([A-Za-z_][A-Za-z0-9_]*)(?!\w|\s*\()")  # a field, not a method or macro call
_HAS = re.compile(r"(?<![\w.])has\s*\(")
ORDERED = "treadle_ordered"  # the function put before each comprehension macro: a map's keys, sorted


def _code_only(expr: str) -> str:
    """`expr` with its string and bytes literals and comments blanked out (same length): where to look for code."""
    out, i, n = list(expr), 0, len(expr)
    while i < n:
        ch = expr[i]
        if ch == "/" and expr.startswith("//", i):
            end = expr.find("\n", i)
            end = n if end < 0 else end
        elif ch in "'\"":
            k = i
            while i - k < 2 and k > 0 and expr[k - 1] in "rRbB":
                k -= 1
            raw = "r" in expr[k:i].lower() and not (k > 0 and (expr[k - 1].isalnum() or expr[k - 1] == "_"))
            quote = ch * 3 if expr.startswith(ch * 3, i) else ch
            j = i + len(quote)
            while j < n and not expr.startswith(quote, j):
                j += 2 if expr[j] == "\\" and not raw else 1
            end = min(j + len(quote), n)
        else:
            i += 1
            continue
        out[i:end] = "#" * (end - i)
        i = end
    return "".join(out)


def _has_arguments(code: str) -> list[tuple[int, int]]:
    """Where the arguments of `has(...)` macros lie in `code` (see _code_only)."""
    spans = []
    for match in _HAS.finditer(code):
        depth, j = 1, match.end()
        while j < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[j], 0)
            j += 1
        spans.append((match.end(), j))
    return spans


def engine_source(expr: str) -> str:
    """`expr` as the engine runs it; the same meaning, made deterministic and cheap:

    - each comprehension macro's range is put in a fixed order: `m.exists(k, p)` becomes
      `m.treadle_ordered().exists(k, p)`, which iterates a map's keys sorted (a list stays as it is). The engine
      keeps maps in hash order, which changes from process to process: without this, `map`/`filter` results and
      which element an `all`/`exists` stops at (a failing one, or the one that decides) would differ between replays;
    - a field selection is written as an index, `state.nodes` as `state["nodes"]` (but the one `has()` tests): the
      same on a map (and the same error elsewhere), but the engine copies the whole selected value on a selection,
      which made a clause reading `state.nodes` cost time in proportion to the world's size."""
    code = _code_only(expr)
    selects = list(_SELECT.finditer(code))
    tested = {max((m.start() for m in selects if start <= m.start() < end), default=-1)  # has() tests its last one
              for start, end in _has_arguments(code)}  # fmt: skip
    edits = [(m.start(), m.start(), f".{ORDERED}()") for m in _MACRO_CALL.finditer(code)]
    edits += [(m.start(), m.end(), f'["{m.group(1)}"]') for m in selects if m.start() not in tested]
    for start, end, text in sorted(edits, reverse=True):
        expr = expr[:start] + text + expr[end:]
    return _node_handles(_world_parts(expr)) if not _bound_names(expr) & {"state", "before", "result"} else expr


_WORLD_PART = re.compile(r"(?<![\w.])(state|before|result)\s*\[(#+)\]")
_WORLD_FIELDS = ("nodes", "version")
RESULT_FIELDS = ("status", "output", "error", "latency_ms", "json")  # the keys of result_view
_PARTS = {
    name: {f"{q}{field}{q}": field for field in fields for q in "\"'"}
    for name, fields in (("state", _WORLD_FIELDS), ("before", _WORLD_FIELDS), ("result", RESULT_FIELDS))
}


def _world_parts(expr: str) -> str:
    """`state["nodes"]` as the variable `treadle_state_nodes` (and so for `version` and `before`): the world's nodes
    are then bound on their own, and reused while the world is unchanged (see WorldCache). And `result["status"]` as
    `treadle_result_status` (so for each of its fields): only the fields a clause reads are converted, without the
    map's keys (the map always has them, so the same value)."""
    edits = []
    for m in _WORLD_PART.finditer(_code_only(expr)):
        part = _PARTS[m.group(1)].get(expr[m.start(2) : m.end(2)])
        if part is not None:
            edits.append((m.start(), m.end(), f"treadle_{m.group(1)}_{part}"))
    for start, end, text in reversed(edits):
        expr = expr[:start] + text + expr[end:]
    return expr


_NODES_REF = re.compile(r"(?<![\w.])treadle_(state|before)_nodes(?!\w)")
_KEYS_METHOD = re.compile(r"\.\s*(?:treadle_ordered|size)\s*\(\s*\)")  # a macro's range (its keys), its size
_HAS_SELECT = re.compile(r"\.\s*[A-Za-z_]\w*\s*\)")  # has(nodes.key)
_BEFORE_HAS = re.compile(r"(?<![\w.])has\s*\(\s*$")
_BEFORE_SIZE = re.compile(r"(?<![\w.])size\s*\(\s*$")
_BEFORE_IN = re.compile(r"(?<![\w.])in\s*$")


def _closing_bracket(code: str, start: int) -> int | None:
    depth = 0
    for j in range(start, len(code)):
        depth += {"[": 1, "]": -1}.get(code[j], 0)
        if depth == 0:
            return j
    return None


def _node_handles(expr: str) -> str:
    """`treadle_state_nodes[k]` as `treadle_state_nodeopts[k].value()` (and so for `before`) when every use of the
    world's nodes in `expr` is an index, a membership test (`in`), `size`, `has()` of a key or a macro's range: the
    nodes are then bound as a map of engine handles (cel.OptionalValue, one per node, converted when the node
    changes: see WorldCache), which the engine takes without converting the nodes again. The same keys, and the
    same value for each (`.value()` of a handle is its node), so the same outcome. Any other use (the map compared,
    passed whole, `[?k]`...) keeps the plain map."""
    code, edits = _code_only(expr), []
    for m in _NODES_REF.finditer(code):
        head, rest = code[: m.start()], code[m.end() :]
        after = rest.lstrip()
        at = m.end() + len(rest) - len(after)  # where the next token starts
        if after.startswith("["):
            close = _closing_bracket(code, at)
            if close is None or code[at + 1 : close].lstrip().startswith("?"):
                return expr
            edits.append((close + 1, close + 1, ".value()"))
        elif after.startswith("."):
            if not (_KEYS_METHOD.match(after) or (_HAS_SELECT.match(after) and _BEFORE_HAS.search(head))):
                return expr
        elif after.startswith("("):
            return expr
        elif not (_BEFORE_IN.search(head) or (_BEFORE_SIZE.search(head) and after.startswith(")"))):
            return expr  # the map as a value: compared, in a list, passed to a function...
        edits.append((m.start(), m.end(), f"treadle_{m.group(1)}_nodeopts"))
    for start, end, text in sorted(edits, reverse=True):
        expr = expr[:start] + text + expr[end:]
    return expr


def _sort_key(key: Any) -> tuple[str, Any]:
    return type(key).__name__, key


def ordered(value: Any) -> Any:
    """A map's keys, sorted (by type, then value); anything else as it is."""
    return sorted(value, key=_sort_key) if isinstance(value, dict) else value


_FUNCTIONS = {ORDERED: ordered}


@dataclass(frozen=True)
class CompiledClause:
    phase: str  # preconditions, params or postconditions
    clause: Clause
    program: Any  # cel.Program, compiled once
    variables: frozenset[str]  # the variables it reads
    uses_ordered: bool  # it calls ORDERED (it has a comprehension macro)
    binds: frozenset[str] = frozenset()  # what the engine reads: variables, or their parts (treadle_state_nodes...)

    def evaluate(self, context: Any) -> bool | str:
        """True or False, or why it could not be evaluated, in a cel.Context (see bind)."""
        try:
            value = self.program.execute(context)
        except KeyError as exc:  # a missing map key or field
            return f"no such key: {exc.args[0] if exc.args else ''}"
        except Exception as exc:  # no such overload, an undefined variable or function, overflow, a bad regex...
            return f"{type(exc).__name__}: {_first_sentence(str(exc))}"
        except BaseException as exc:  # a panic in the engine: pyo3's PanicException is not an Exception
            if type(exc).__name__ != "PanicException":
                raise
            return f"the CEL engine failed: {_first_sentence(str(exc))}"
        if isinstance(value, bool):
            return value
        return f"evaluated to {type(value).__name__}, not a bool"


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.split(". ", 1)[0][:200]


def _bound_names(expr: str) -> set[str]:
    """Names a comprehension macro binds (`k` in `m.exists(k, ...)`): not free variables."""
    return {m.group(1) for m in _MACRO_BOUND.finditer(_code_only(expr))}


def compile_clauses(contract: Contract) -> tuple[list[CompiledClause], list[str]]:
    """Every clause compiled, and a reason for each that does not compile or reads a variable its phase lacks."""
    compiled, reasons = [], []
    for phase, clauses in (("preconditions", contract.preconditions), ("params", contract.params),
                           ("postconditions", contract.postconditions)):  # fmt: skip
        for clause in clauses:
            try:
                program = cel.compile(clause.expr)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                reasons.append(f"{phase} clause {clause.name!r} does not compile: {first}")
                continue
            variables = set(program.variables()) - _bound_names(clause.expr)
            unknown = sorted(variables - PHASE_VARIABLES[phase])
            if unknown:
                allowed = ", ".join(sorted(PHASE_VARIABLES[phase]))
                reasons.append(f"{phase} clause {clause.name!r} reads {', '.join(unknown)}; {phase} see only {allowed}")
                continue
            source = engine_source(clause.expr)
            if source != clause.expr:
                program = cel.compile(source)
            macros = _MACRO_CALL.search(_code_only(clause.expr)) is not None
            binds = frozenset(set(program.variables()) - _bound_names(source))
            compiled.append(CompiledClause(phase, clause, program, frozenset(variables), macros, binds))
    return compiled, reasons


def bind(
    clauses: Iterable[CompiledClause],
    views: Mapping[str, Callable[[], Any]],
    context: Any = None,
    bound: frozenset[str] = frozenset(),
) -> Any:
    """A cel.Context for evaluating `clauses`: each variable (or part, see CompiledClause.binds) they read converted
    once (the conversion costs more than most evaluations), from `views` (name -> a function that makes its Python
    value), into `context` when given (one from a WorldCache, where the names in `bound` are bound already) or a
    new one. A name without a view, or whose value the engine cannot hold, is left out, so a clause reading it is
    not evaluable."""
    clauses = list(clauses)
    names = set().union(*(c.binds for c in clauses)) - bound
    variables = {}
    for name in sorted(names):
        view = views.get(name)
        if view is not None:
            try:
                variables[name] = view()
            except ValueError:  # a node the engine cannot hold (see node_handles)
                pass
    if context is not None:
        try:
            context.update(variables)
            return context
        except ValueError:  # the cached context may now hold a stale value: start afresh
            return bind(clauses, views)
    context = cel.Context(None, _FUNCTIONS if any(c.uses_ordered for c in clauses) else None)
    try:
        context.update(variables)
    except ValueError:  # a value the engine cannot hold (not JSON data): leave it out, its clauses are not evaluable
        for name, value in variables.items():
            with contextlib.suppress(ValueError):
                context.add_variable(name, value)
    return context


_WORLD_NAMES = frozenset({"treadle_state_nodes", "treadle_state_nodeopts"})


@dataclass
class _World:
    key: Any  # names the world's content (see WorldCache)
    context: Any  # cel.Context binding treadle_state_nodeopts (and treadle_state_nodes once a clause reads it)
    handles: dict[str, tuple[Any, Any]]  # node id -> (its change mark, cel.OptionalValue of its view)
    full: bool = False  # treadle_state_nodes is bound
    functions: bool = False  # ORDERED is registered (a context with a Python function costs more per change)


class WorldCache:
    """Per session, its world's nodes converted to the engine's values: converting is most of a check's cost.

    Each node is converted once per change into an engine handle (see node_handles), kept while its change mark
    (the session's ordinal that last changed it) is the same, so a step that changes one node converts one node;
    the cel.Context binding them is reused while the whole world is unchanged (between a dispatch and its result,
    and over steps that change nothing). `key` and the marks name content (a session's state at an ordinal is a
    function of its versions), so reuse cannot change an outcome."""

    def __init__(self, sessions: int = 1024) -> None:
        self._sessions = sessions
        self._worlds: dict[str, _World] = {}

    def context(
        self,
        session: str,
        key: Any,
        nodes: Nodes,
        changed: Mapping[str, Any] | None = None,
        full: bool = False,
        functions: bool = True,
    ) -> Any:
        """A context binding the world's nodes as handles (and as a plain map when `full`, and ORDERED when
        `functions`); `changed`: node id -> its change mark (without it, every node is converted)."""
        world = self._worlds.pop(session, None)
        if world is None or world.key != key:
            world = self._convert(key, nodes, changed or {}, world.handles if world is not None else {})
        if functions and not world.functions:
            world.context.add_function(ORDERED, ordered)
            world.functions = True
        if full and not world.full:
            with contextlib.suppress(ValueError):  # left out: its clauses are not evaluable
                world.context.update({"treadle_state_nodes": nodes_view(nodes)})
            world.full = True
        self._worlds[session] = world  # last used last; the oldest is dropped past the bound
        if len(self._worlds) > self._sessions:
            self._worlds.pop(next(iter(self._worlds)))
        return world.context

    @staticmethod
    def _convert(key: Any, nodes: Nodes, changed: Mapping[str, Any], known: dict[str, tuple[Any, Any]]) -> _World:
        handles: dict[str, tuple[Any, Any]] = {}
        try:
            for nid, (node_type, data) in nodes.items():
                if node_type in AUTO_NODE_TYPES:
                    continue
                mark, seen = changed.get(nid), known.get(nid)
                if mark is not None and seen is not None and seen[0] == mark:
                    handles[nid] = seen
                else:
                    handles[nid] = (mark, cel.OptionalValue.of(node_view(nid, node_type, data)))
        except ValueError:  # a node the engine cannot hold: the world is left out, its clauses are not evaluable
            return _World(key, cel.Context(), {})
        bound = {"treadle_state_nodeopts": {nid: handle for nid, (_, handle) in handles.items()}}
        return _World(key, cel.Context(bound), handles)


def node_types_read(contract: Contract) -> set[str]:
    """Node types the contract names: its `node_types`, and literals compared with a node's `.type`."""
    found = set(contract.node_types)
    for clause in contract.clauses():
        for match in _TYPE_LITERAL.finditer(clause.expr):
            found.add(match.group(1) or match.group(2))
    return found


def _normal(expr: str) -> str:
    return "".join(expr.split())


def narrowing(old: Contract, new: Contract) -> list[str]:
    """Why `new` allows fewer actions than `old` (empty when it does not): a precondition or parameter constraint
    added or changed, or the tool changed. An agent or policy trained on `old`'s action mask would find actions
    refused that were allowed; removing clauses and changing postconditions are fine."""
    reasons = []
    if old.tool != new.tool:
        reasons.append(f"tool changed from {old.tool!r} to {new.tool!r}")
    for phase in ("preconditions", "params"):
        before = {_normal(c.expr) for c in getattr(old, phase)}
        for clause in getattr(new, phase):
            if _normal(clause.expr) not in before:
                reasons.append(f"{phase} clause {clause.name!r} is new or changed: it narrows version {old.version}")
    return reasons


def registration_problems(contract: Contract, known_node_types: Iterable[str], previous: Contract | None) -> list[str]:
    """Every reason to refuse registering `contract` (empty: it may be registered)."""
    _, reasons = compile_clauses(contract)
    known = set(known_node_types) | AUTO_NODE_TYPES
    unknown = sorted(node_types_read(contract) - known)
    if unknown:
        reasons.append(f"unknown node type(s) {', '.join(unknown)} (registered: {', '.join(sorted(known))})")
    if not contract.clauses():
        reasons.append("no clauses: a contract needs at least one precondition, parameter constraint or postcondition")
    if previous is not None:
        reasons += narrowing(previous, contract)
    return reasons


# -- the views --------------------------------------------------------------------------------------------------------

Nodes = Mapping[str, tuple[str, Any]]  # node id -> (type, data)


def node_view(node_id: str, node_type: str, data: Any) -> dict[str, Any]:
    return {"id": node_id, "type": node_type, "data": data}


def nodes_view(nodes: Nodes) -> dict[str, Any]:
    """`state.nodes`: the world's nodes (auto nodes left out)."""
    return {nid: node_view(nid, t, d) for nid, (t, d) in nodes.items() if t not in AUTO_NODE_TYPES}


def state_view(version: str, nodes: Nodes) -> dict[str, Any]:
    """The `state`/`before` variable: the version id and the world's nodes (auto nodes left out)."""
    return {"version": version, "nodes": nodes_view(nodes)}


def node_handles(nodes: Nodes) -> dict[str, Any]:
    """`state.nodes` as the engine reads it after _node_handles: each node's view held as a cel.OptionalValue (the
    engine converts it there, once; ValueError when it cannot hold it)."""
    of = cel.OptionalValue.of
    return {nid: of(node_view(nid, t, d)) for nid, (t, d) in nodes.items() if t not in AUTO_NODE_TYPES}


def world_views(name: str, version: str, nodes: Nodes) -> dict[str, Callable[[], Any]]:
    """The views of `state` or `before` (`name`), whole and in parts (see CompiledClause.binds)."""
    return {
        name: lambda: state_view(version, nodes),
        f"treadle_{name}_nodes": lambda: nodes_view(nodes),
        f"treadle_{name}_nodeopts": lambda: node_handles(nodes),
        f"treadle_{name}_version": lambda: version,
    }


_JSON_STARTS = frozenset('{["-0123456789tfn')


def result_view(result: Mapping[str, Any]) -> dict[str, Any]:
    """The `result` variable from a tool result (its record or its state node's data)."""
    output = result.get("output") or ""
    parsed = None
    if output.lstrip(" \t\n\r")[:1] in _JSON_STARTS:  # else not JSON: no parse (its error costs more than a parse)
        try:
            parsed = orjson.loads(output)
        except orjson.JSONDecodeError:
            parsed = None
    return {
        "status": result.get("status", ""),
        "output": output,
        "error": result.get("error"),
        "latency_ms": float(result.get("latency_ms") or 0.0),
        "json": parsed,
    }


# -- checking ---------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Check:
    """One contract's outcome in one phase of one step (not frozen: one is made per contract and step, and a frozen
    dataclass costs several times as much to make)."""

    contract: str
    version: int
    tool: str
    phase: Phase
    outcome: Outcome
    clause: str | None  # the first violated (else not evaluable) clause
    failed: tuple[str, ...]  # every violated or not evaluable clause
    reason: str | None  # why the first failed clause was not evaluable (None when violated or passed)
    values: dict[str, Any]  # what the clauses saw that matters: params, the nodes they name, the result

    @property
    def values_json(self) -> str:
        return orjson.dumps(self.values, option=orjson.OPT_SORT_KEYS).decode()


class CompiledContract:
    """A contract ready to evaluate; build it once per version."""

    def __init__(self, contract: Contract) -> None:
        clauses, reasons = compile_clauses(contract)
        if reasons:
            raise ContractError(contract.name, reasons)
        self.contract = contract
        self.pre = [c for c in clauses if c.phase != "postconditions"]
        self.post = [c for c in clauses if c.phase == "postconditions"]
        self.preconditions = [c for c in clauses if c.phase == "preconditions"]
        self.reads_before = any("before" in c.variables for c in self.post)  # needs the state at the dispatch kept

    def available(self, context: Any) -> bool:
        """Whether every precondition holds (`context` binds `state`, see bind): the action mask."""
        return all(c.evaluate(context) is True for c in self.preconditions)

    def check(
        self, phase: Phase, context: Any, values: dict[str, Any], unknown: str = "", seen: dict[str, Any] | None = None
    ) -> Check | None:
        """The outcome of `phase`'s clauses in `context` (see bind), None when the phase has no clause. A clause
        reading the variable named `unknown` is not evaluable without being run. `seen` (engine source -> result)
        shares the results of the same clause in several contracts checked in the same context: the engine is pure,
        so one evaluation gives every copy's result."""
        clauses = self.pre if phase is Phase.PRE else self.post
        if not clauses:
            return None
        violated, broken = [], []
        for compiled in clauses:
            if unknown and unknown in compiled.variables:
                result: bool | str = f"{unknown} is not known for this step"
            elif seen is None:
                result = compiled.evaluate(context)
            else:
                source = compiled.program.source
                result = seen.get(source)  # type: ignore[assignment]
                if result is None:
                    result = seen[source] = compiled.evaluate(context)
            if result is False:
                violated.append(compiled.clause.name)
            elif result is not True:
                broken.append((compiled.clause.name, result))
        c = self.contract
        if violated:
            failed = (*violated, *(name for name, _ in broken))
            return Check(c.name, c.version, c.tool, phase, Outcome.VIOLATED, violated[0], failed, None, values)
        if broken:
            names = tuple(name for name, _ in broken)
            return Check(c.name, c.version, c.tool, phase, Outcome.NOT_EVALUABLE, names[0], names, broken[0][1], values)
        return Check(c.name, c.version, c.tool, phase, Outcome.PASSED, None, (), None, values)


def _named_node(nodes: Nodes, node_id: str) -> dict[str, Any] | None:
    node = nodes.get(node_id)
    return node_view(node_id, *node) if node is not None and node[0] not in AUTO_NODE_TYPES else None


def seen_values(
    params: Any,
    state: tuple[str, Nodes],
    before: tuple[str, Nodes] | None = None,
    result: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The values a check row keeps: the params, the state nodes whose ids are param values (before and after), the
    state versions, and the result (output cut to a few hundred characters)."""
    ids = sorted({v for v in (params.values() if isinstance(params, dict) else ()) if isinstance(v, str)})
    version, nodes = state
    values: dict[str, Any] = {"params": params, "state_version": version}
    named = {i: _named_node(nodes, i) for i in ids}
    values["nodes"] = named if before is not None else {i: n for i, n in named.items() if n is not None}
    if before is not None:
        values["before_version"] = before[0]
        values["before_nodes"] = {i: _named_node(before[1], i) for i in ids}
    if result is not None:
        output = result.get("output") or ""
        values["result"] = {"status": result.get("status"), "error": result.get("error"),
                            "output": output[:_MAX_SEEN_CHARS]}  # fmt: skip
    return values


def _world(
    clauses: list[CompiledClause],
    views: dict[str, Callable[[], Any]],
    cache: WorldCache | None,
    world: tuple[str, Any, Nodes, Mapping[str, Any] | None] | None,
) -> Any:
    """The context for `clauses`, from the cache when given (`world`: session, key, nodes, change marks) and they
    read the nodes."""
    reads = set().union(*(c.binds for c in clauses)) & _WORLD_NAMES
    if cache is None or world is None or not reads:
        return bind(clauses, views)
    context = cache.context(*world, full="treadle_state_nodes" in reads, functions=any(c.uses_ordered for c in clauses))
    return bind(clauses, views, context, bound=_WORLD_NAMES)


def check_pre(
    contracts: Sequence[CompiledContract],
    version: str,
    nodes: Nodes,
    params: Any,
    cache: WorldCache | None = None,
    world: tuple[str, Any] | None = None,
    changed: Mapping[str, Any] | None = None,
) -> list[Check]:
    """Every contract's preconditions and parameter constraints at a dispatch, over the state it acted on. With a
    `cache`, `world` is (session, key of `nodes`' content), `changed` each node's change mark (see WorldCache), and
    the converted nodes are reused."""
    clauses = [c for contract in contracts for c in contract.pre]
    if not clauses:
        return []
    views = {**world_views("state", version, nodes), "params": lambda: params}
    context = _world(clauses, views, cache, (*world, nodes, changed) if world else None)
    values, seen = seen_values(params, (version, nodes)), {}
    return [c for contract in contracts if (c := contract.check(Phase.PRE, context, values, "", seen)) is not None]


def check_post(
    contracts: Sequence[CompiledContract],
    before: tuple[str, Nodes] | None,
    after: tuple[str, Nodes],
    params: Any,
    result: Mapping[str, Any],
    cache: WorldCache | None = None,
    world: tuple[str, Any] | None = None,
    changed: Mapping[str, Any] | None = None,
) -> list[Check]:
    """Every contract's postconditions at a tool result: `before` is the state at the dispatch (None when unknown:
    clauses that read it are then not evaluable), `after` the state at the result (`world` as in check_pre)."""
    clauses = [c for contract in contracts for c in contract.post]
    if not clauses:
        return []
    view = result_view(result)
    views = {**world_views("state", *after), "params": lambda: params, "result": lambda: view}
    views.update({f"treadle_result_{field}": lambda field=field: view[field] for field in RESULT_FIELDS})
    if before is not None:
        views.update(world_views("before", *before))
    context = _world(clauses, views, cache, (*world, after[1], changed) if world else None)
    values = seen_values(params, after, before, view)
    unknown, seen = "before" if before is None else "", {}
    checks = (contract.check(Phase.POST, context, values, unknown, seen) for contract in contracts)
    return [c for c in checks if c is not None]


def available_actions(contracts: Iterable[CompiledContract], version: str, nodes: Nodes) -> list[str]:
    """The tools whose every contract's preconditions hold in this state (sorted): the action mask. A tool with no
    contract is not listed (nothing is known about it); a precondition that cannot be evaluated masks the tool."""
    contracts = list(contracts)
    context = bind((c for contract in contracts for c in contract.preconditions), world_views("state", version, nodes))
    by_tool: dict[str, bool] = {}
    for contract in contracts:
        tool = contract.contract.tool
        by_tool[tool] = by_tool.get(tool, True) and contract.available(context)
    return sorted(tool for tool, ok in by_tool.items() if ok)


def effective(contracts: Iterable[Contract], at_us: int) -> list[Contract]:
    """Per contract name, the newest version effective at event time `at_us` (sorted by name)."""
    chosen: dict[str, Contract] = {}
    for contract in contracts:
        if contract.effective_from_us <= at_us:
            known = chosen.get(contract.name)
            if known is None or contract.version > known.version:
                chosen[contract.name] = contract
    return [chosen[name] for name in sorted(chosen)]
