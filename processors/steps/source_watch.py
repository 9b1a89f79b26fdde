"""Required reward sources that have gone silent: steps wait for them, and nothing else says so.

A policy that requires a source nobody emits (a plugin not enabled, a reward job that stopped, a misspelt source
name) leaves every step pending until its window and grace pass. This watch notices first: a source the active policy
requires is *silent* when a step arrived (a dispatch) after its last signal and it has sent nothing for longer than its
window since. Processing time, not event time: it answers "is anything emitting it now".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from processors.steps.policy import RewardPolicy


@dataclass(frozen=True)
class Silence:
    source: str
    silent_s: float  # how long the first step it has not answered has waited
    window_s: float
    ever_seen: bool


@dataclass
class SourceWatch:
    """When each reward source last sent a signal and when the first step after it arrived (processing time, s)."""

    last_signal: dict[str, float] = field(default_factory=dict)
    first_step: float | None = None  # the first dispatch this worker saw: steps wait from then for a source never seen
    step_after: dict[str, float] = field(default_factory=dict)  # source -> first dispatch after its last signal
    silent: set[str] = field(default_factory=set)  # sources reported silent and not heard from since

    def saw(self, now: float, sources: set[str], dispatched: bool) -> None:
        """One batch: the sources that sent signals in it, and whether it held dispatches (counted after them)."""
        for source in sources:
            self.last_signal[source] = now
            self.step_after.pop(source, None)
        if dispatched:
            if self.first_step is None:
                self.first_step = now
            for source in self.last_signal:
                self.step_after.setdefault(source, now)

    def waiting_since(self, source: str) -> float | None:
        """Since when steps have waited for `source` (the first dispatch it has not answered), or None."""
        if source in self.last_signal:
            return self.step_after.get(source)
        return self.first_step

    def check(self, policy: RewardPolicy, now: float) -> tuple[list[Silence], list[str]]:
        """(required sources that fell silent since the last check, sources that spoke again since then)."""
        newly, recovered = [], []
        required = {spec.source: spec for spec in policy.required}  # one window per source: the last spec's
        for source, spec in required.items():
            since = self.waiting_since(source)
            quiet = since is not None and now - since > spec.window_s
            if quiet and source not in self.silent:
                self.silent.add(source)
                assert since is not None
                newly.append(Silence(source, now - since, spec.window_s, source in self.last_signal))
            elif not quiet and source in self.silent:
                self.silent.discard(source)
                recovered.append(source)
        for gone in sorted(self.silent - set(required)):  # no longer required (a new policy): not silent any more
            self.silent.discard(gone)
            recovered.append(gone)
        return newly, recovered
