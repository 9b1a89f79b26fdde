"""Processor plugins: EventProcessor classes found through the `treadle.processors` entry-point group.

A reward source, an evaluator and the core step assembler are all processors; attaching a new one means
installing a package that declares an entry point, not editing treadle. The entry point's name is what
TREADLE_PROCESSORS lists and must equal the class's `name` (it prefixes the processor's Faust tables).
A plugin class declares, as class attributes, `name`, `kind` (core, reward_source or evaluator) and
`inputs` (input schema names), so `treadle processors` can describe it without instantiating it; the worker
instantiates it with no arguments and passes settings to its `setup`.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from streams.runtime.processor import EventProcessor

ENTRY_POINT_GROUP = "treadle.processors"


REINSTALL_HINT = (
    "Install the plugin's package, or reinstall it if you added or renamed its entry point since: pip install -e "
    "<plugin folder>"
)


class ProcessorKind(StrEnum):
    CORE = "core"  # part of treadle's own pipeline (step assembly)
    REWARD_SOURCE = "reward_source"  # emits reward signals that are woven into steps
    EVALUATOR = "evaluator"  # emits evaluation metrics (evaluation_metrics table)


class PluginError(ValueError):
    """A processor that cannot be found, imported or used; the message says which and why."""


@dataclass(frozen=True)
class ProcessorInfo:
    """What `treadle processors` shows about one plugin."""

    name: str
    kind: ProcessorKind
    inputs: tuple[str, ...]
    module: str
    doc: str
    entry_point: str
    distribution: str = ""  # the installed distribution that declares the entry point ("" when unknown)
    version: str = ""  # its version: what `pip install -e` last installed

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": str(self.kind),
            "inputs": list(self.inputs),
            "module": self.module,
            "doc": self.doc,
            "entry_point": self.entry_point,
            "distribution": self.distribution,
            "version": self.version,
        }


def _label(entry_point: importlib.metadata.EntryPoint) -> str:
    return f"{entry_point.name} = {entry_point.value}"


class ProcessorRegistry:
    """The processors the installed distributions declare; loaded lazily, one entry point at a time."""

    def __init__(
        self,
        entry_points: Iterable[importlib.metadata.EntryPoint],
        input_schemas: Iterable[str] | None = None,
    ) -> None:
        self._entry_points: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for entry_point in entry_points:
            same_name = self._entry_points.setdefault(entry_point.name, [])
            if all(e.value != entry_point.value for e in same_name):  # one package seen twice is not a conflict
                same_name.append(entry_point)
        self._input_schemas = frozenset(input_schemas) if input_schemas is not None else _catalog_input_schemas()

    @classmethod
    def discover(cls) -> ProcessorRegistry:
        """The entry points of every installed distribution in the `treadle.processors` group."""
        return cls(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))

    @property
    def names(self) -> list[str]:
        return sorted(self._entry_points)

    def provenance(self, name: str) -> tuple[str, str]:
        """(distribution, version) of the installed package that declares `name`; ("", "") if unknown."""
        candidates = self._entry_points.get(name) or []
        dist = getattr(candidates[0], "dist", None) if len(candidates) == 1 else None
        if dist is None:
            return "", ""
        return str(dist.metadata["Name"] or ""), str(dist.version or "")

    def missing(self, names: Sequence[str]) -> list[str]:
        """The names no installed entry point provides (a plugin not installed, or installed before its entry point
        was added: entry points are metadata, written by `pip install`)."""
        return [n for n in names if n not in self._entry_points]

    def load(self, name: str) -> type[EventProcessor]:
        """The processor class registered as `name`, checked; PluginError says what is wrong with it."""
        candidates = self._entry_points.get(name)
        if not candidates:
            known = ", ".join(self.names) or "none installed"
            raise PluginError(f"unknown processor {name!r} (entry point group {ENTRY_POINT_GROUP}); known: {known}")
        if len(candidates) > 1:
            found = "; ".join(_label(e) for e in candidates)
            raise PluginError(f"processor {name!r} is registered by more than one entry point: {found}")
        entry_point = candidates[0]
        try:
            loaded = entry_point.load()
        except Exception as exc:
            hint = _import_hint(entry_point, exc)
            raise PluginError(f"processor plugin {_label(entry_point)} failed to import: {exc!r}{hint}") from exc
        self._check(entry_point, loaded)
        return loaded

    def _check(self, entry_point: importlib.metadata.EntryPoint, loaded: Any) -> None:
        where = f"processor plugin {_label(entry_point)}"
        if not isinstance(loaded, type):
            raise PluginError(f"{where} is not a class")
        missing = [a for a in ("name", "kind", "inputs", "setup", "process") if not hasattr(loaded, a)]
        if missing:
            raise PluginError(f"{where} lacks the class attribute(s) {', '.join(missing)} of an EventProcessor")
        if loaded.name != entry_point.name:
            raise PluginError(f"{where} names itself {loaded.name!r}; the entry point must be named the same")
        if loaded.kind not in set(ProcessorKind):
            kinds = ", ".join(ProcessorKind)
            raise PluginError(f"{where} has kind {loaded.kind!r}; expected one of {kinds}")
        unknown = sorted(set(loaded.inputs) - self._input_schemas)
        if unknown:
            raise PluginError(f"{where} reads {unknown}, which no input topic carries: {sorted(self._input_schemas)}")

    def create(self, names: Sequence[str]) -> list[EventProcessor]:
        """One instance of each named processor, in that order (TREADLE_PROCESSORS)."""
        unknown = self.missing(names)
        if unknown:
            known = ", ".join(self.names) or "none installed"
            raise PluginError(f"unknown processor(s) {', '.join(unknown)} in TREADLE_PROCESSORS; known: {known}. "
                              f"{REINSTALL_HINT}")  # fmt: skip
        repeated = sorted({n for n in names if list(names).count(n) > 1})
        if repeated:
            raise PluginError(f"processor(s) {', '.join(repeated)} listed twice in TREADLE_PROCESSORS")
        return [self.load(name)() for name in names]

    def describe(self) -> tuple[list[ProcessorInfo], list[PluginError]]:
        """Every plugin that loads, and an error for each that does not (listing should not stop at the first)."""
        infos, errors = [], []
        for name in self.names:
            try:
                cls = self.load(name)
            except PluginError as exc:
                errors.append(exc)
                continue
            distribution, version = self.provenance(name)
            infos.append(
                ProcessorInfo(
                    name=name,
                    kind=ProcessorKind(cls.kind),
                    inputs=tuple(sorted(cls.inputs)),
                    module=cls.__module__,
                    doc=_first_line(cls.__doc__),
                    entry_point=self._entry_points[name][0].value,
                    distribution=distribution,
                    version=version,
                )
            )
        return infos, errors


def _import_hint(entry_point: importlib.metadata.EntryPoint, exc: Exception) -> str:
    """Why an installed plugin may not import: its module is missing, or a folder of the same name (in the current
    directory, say) shadows it; both are packaging problems, not bugs in the plugin."""
    top = entry_point.module.split(".", 1)[0]
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".", 1)[0] == top:
        return (f"; the module {top!r} is not importable here: reinstall the plugin's package (pip install -e "
                "<plugin folder>), with its module under src/ as `treadle plugin new` lays it out")  # fmt: skip
    module = sys.modules.get(entry_point.module)
    if module is not None and getattr(module, "__file__", None) is None:
        where = ", ".join(getattr(module, "__path__", [])) or "a folder"
        return (f"; {entry_point.module!r} resolved to {where}, a folder without __init__.py, not the installed "
                "plugin: a folder of that name where the worker starts shadows it (src/ layouts avoid it)")  # fmt: skip
    return ""


def _first_line(doc: str | None) -> str:
    lines = [line.strip() for line in (doc or "").strip().splitlines()]
    return lines[0] if lines else ""


def _catalog_input_schemas() -> frozenset[str]:
    """Schemas of the input topics; the same for every deployment (settings only change names and sizes)."""
    from topics.catalog import TopicCatalog
    from topics.settings import Settings

    return frozenset(schema for s in TopicCatalog(Settings()).inputs for schema in s.schemas)
