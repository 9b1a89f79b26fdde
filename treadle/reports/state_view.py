"""`treadle state <session>`: the graph at a version or time as a tree, a diff as a table, or JSON for export."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from processors.state.model import StateGraph
from topics.settings import Settings
from treadle.state.history import StateDiff, state_at, state_diff


def _short(value: Any, width: int = 70) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def graph_tree(graph: StateGraph) -> Tree:
    """Nodes grouped by type; each node lists its outgoing edges."""
    tree = Tree(f"[bold]{graph.version_id}[/bold]  ({len(graph.nodes)} nodes, {len(graph.edges)} edges)")
    outgoing: dict[str, list[str]] = {}
    for e in sorted(graph.edges, key=lambda e: (e.src, e.type, e.dst)):
        outgoing.setdefault(e.src, []).append(f"─{e.type}→ {e.dst}" + (f"  {_short(e.data)}" if e.data else ""))
    by_type: dict[str, list[str]] = {}
    for node_id in sorted(graph.nodes):
        by_type.setdefault(graph.nodes[node_id].type, []).append(node_id)
    for node_type, ids in sorted(by_type.items()):
        branch = tree.add(f"[cyan]{node_type}[/cyan] ({len(ids)})")
        for node_id in ids:
            node = graph.nodes[node_id]
            leaf = branch.add(f"{node_id}  {_short(node.data)}", highlight=False)
            for line in outgoing.get(node_id, []):
                leaf.add(line, highlight=False)
    dangling = sorted(set(outgoing) - set(graph.nodes))
    if dangling:
        branch = tree.add("[dim]edges from nodes not in this state[/dim]")
        for src in dangling:
            leaf = branch.add(src)
            for line in outgoing[src]:
                leaf.add(line, highlight=False)
    return tree


def diff_table(d: StateDiff) -> Table:
    table = Table(title=f"{d.before.version_id} → {d.after.version_id}", show_header=True, header_style="bold")
    for column in ("", "kind", "id", "type", "data"):
        table.add_column(column)
    for n in d.added:
        table.add_row("[green]+[/green]", "node", n.id, n.type, _short(n.data))
    for n in d.removed:
        table.add_row("[red]-[/red]", "node", n.id, n.type, _short(n.data))
    for a, b in d.changed:
        table.add_row("[yellow]~[/yellow]", "node", b.id, b.type, f"{_short(a.data, 34)} → {_short(b.data, 34)}")
    for e in d.edges_added:
        table.add_row("[green]+[/green]", "edge", f"{e.src} → {e.dst}", e.type, _short(e.data))
    for e in d.edges_removed:
        table.add_row("[red]-[/red]", "edge", f"{e.src} → {e.dst}", e.type, _short(e.data))
    return table


def run_state_command(
    settings: Settings, session: str, at: str | None, diff_range: str | None, as_json: bool, console: Console
) -> None:
    """What `treadle state` does; raises ValueError/StateNotFoundError/QueryFailedError for the CLI to print."""
    if diff_range is not None:
        if ".." not in diff_range:
            raise ValueError("--diff takes two versions (or ordinals / times) as V1..V2")
        first, second = diff_range.split("..", 1)
        result = state_diff(settings, session, first, second)
        if as_json:
            sys.stdout.write(json.dumps(result.to_json(), default=str) + "\n")
        else:
            console.print(diff_table(result))
        return
    graph = state_at(settings, session, at or "now")
    if as_json:
        sys.stdout.write(json.dumps(graph.to_json(), default=str) + "\n")
    else:
        console.print(graph_tree(graph))
