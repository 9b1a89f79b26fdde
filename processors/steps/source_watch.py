"""Required reward sources that have gone silent: steps wait for them, and nothing else says so.

A policy that requires a source nobody emits (a plugin not enabled, a reward job that stopped, a misspelt source
name) leaves every step pending until its window and grace pass. This watch notices first: a source the active policy
requires is *silent* when steps kept arriving (dispatches) but no signal from it came for longer than its window.
Processing time, not event time: it answers "is anything emitting it now", and a backlog replay does not trip it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from processors.steps.policy import RewardPolicy


@dataclass(frozen=True)
class Silence:
    source: str
    silent_s: float  # since its last signal, or since steps started arriving if it never sent one
    window_s: float
    ever_seen: bool


@dataclass
class SourceWatch:
    """When each reward source last sent a signal, and since when steps have been arriving (processing time, s)."""

    last_signal: dict[str, float] = field(default_factory=dict)
    steps_since: float | None = None  # the first dispatch seen by this worker
    silent: set[str] = field(default_factory=set)  # sources reported silent and not heard from since

    def saw_dispatch(self, now: float) -> None:
        if self.steps_since is None:
            self.steps_since = now

    def saw_signal(self, source: str, now: float) -> None:
        self.last_signal[source] = now

    def check(self, policy: RewardPolicy, now: float) -> tuple[list[Silence], list[str]]:
        """(required sources that fell silent since the last check, sources that spoke again since then)."""
        if self.steps_since is None:
            return [], []
        newly, recovered = [], []
        for spec in policy.required:
            heard = self.last_signal.get(spec.source)
            since = max(heard, self.steps_since) if heard is not None else self.steps_since
            quiet = now - since > spec.window_s
            if quiet and spec.source not in self.silent:
                self.silent.add(spec.source)
                newly.append(Silence(spec.source, now - since, spec.window_s, heard is not None))
            elif not quiet and spec.source in self.silent:
                self.silent.discard(spec.source)
                recovered.append(spec.source)
        required = {spec.source for spec in policy.required}
        for gone in sorted(self.silent - required):  # no longer required (a new policy): not silent any more
            self.silent.discard(gone)
            recovered.append(gone)
        return newly, recovered
