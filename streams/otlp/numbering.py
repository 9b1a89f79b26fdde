"""Step numbers and seqs for mapped spans, in the order the receiver saw them; no I/O.

Spans carry no step number, and one trace may arrive over many requests (a batch span processor exports spans as
they end), so the receiver numbers them: per session, each new tool span gets the next step and every event the next
seq, as one SDK stream would. A span seen again keeps its numbers (its events are duplicates anyway: same ids).
`EPISODE_ENDED` gets the episode's step count, which the credit processor waits for. The memory is bounded (least
recently used sessions are forgotten) and per process: see the OTLP page for what that means for restarts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from streams.otlp.mapping import MappedEvent
from topics.names import DISPATCH, LIFECYCLE

DEFAULT_MAX_SESSIONS = 100_000


@dataclass
class _Session:
    next_seq: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # logical_event_id -> step
    seqs: dict[str, int] = field(default_factory=dict)  # event_id -> seq
    episode_steps: dict[str, int] = field(default_factory=dict)  # episode_id -> tool spans seen


class SessionNumbering:
    """Gives mapped events their seq (and dispatches their step) per session; remembers traces' sessions."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.trace_sessions: OrderedDict[str, str] = OrderedDict()  # trace id -> session, for later requests

    def number(self, events: list[MappedEvent]) -> None:
        """Fill in envelope.seq, a dispatch's step and an episode end's steps, in list order."""
        for event in events:
            env = event.record["envelope"]
            session = self._session(env["session_id"])
            self._remember_trace(env["episode_id"], env["session_id"])
            if event.schema == DISPATCH:
                lid = env["logical_event_id"]
                if lid not in session.steps:
                    session.steps[lid] = len(session.steps)
                    session.episode_steps[env["episode_id"]] = session.episode_steps.get(env["episode_id"], 0) + 1
                event.record["step"] = session.steps[lid]
            elif event.schema == LIFECYCLE and event.record["kind"] == "EPISODE_ENDED":
                event.record["steps"] = session.episode_steps.get(env["episode_id"], 0)
            seq = session.seqs.get(env["event_id"])
            if seq is None:
                seq = session.seqs[env["event_id"]] = session.next_seq
                session.next_seq += 1
            env["seq"] = seq

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        return session

    def _remember_trace(self, trace_id: str, session_id: str) -> None:
        if trace_id == session_id:
            return
        self.trace_sessions[trace_id] = session_id
        self.trace_sessions.move_to_end(trace_id)
        while len(self.trace_sessions) > self.max_sessions:
            self.trace_sessions.popitem(last=False)
