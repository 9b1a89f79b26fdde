"""What a console request may ask for: query strings parsed into pydantic models, strictly.

Every value a person can type reaches SQL only as a bound parameter (treadle.console.queries); these models add
a second fence: bounded lengths, no control characters, enumerated sort keys and statuses, bounded pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from topics.model_errors import field_errors


def _printable(text: str) -> str:
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        raise ValueError("control characters are not allowed")
    return text


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


Text = Annotated[str, Field(max_length=200), AfterValidator(_printable)]
Time = Annotated[datetime, AfterValidator(_utc)]


class BadRequestError(ValueError):
    """A query string the console refuses; the message is one line for the page."""


class _Params(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, str_strip_whitespace=True)

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> Any:
        """The model from a request's query string; blank fields count as absent. BadRequestError if invalid."""
        values = {k: v for k, v in query.items() if v != ""}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise BadRequestError(field_errors(exc, "query")[0]) from None


class SessionFilter(_Params):
    """The sessions list: filters, sort and page."""

    agent: Text | None = None
    policy: Text | None = None
    since: Time | None = None
    until: Time | None = None
    status: Literal["any", "open", "ended"] = "any"
    q: Text | None = Field(default=None, description="A session id (or its prefix), an episode id or a step id.")
    sort: Literal["session", "agent", "started", "last", "steps", "dead_letters", "late"] = "last"
    order: Literal["asc", "desc"] = "desc"
    page: int = Field(default=1, ge=1, le=100_000)
    size: int = Field(default=50, ge=5, le=500)

    def query_string(self, **changes: Any) -> str:
        """This filter as a query string, with `changes` (a sort or page link keeps the other filters)."""
        from urllib.parse import urlencode

        values = {**self.model_dump(exclude_none=True), **changes}
        values = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in values.items()}
        return urlencode(values)


class SessionRef(_Params):
    session: Text


class StateParams(_Params):
    """The state explorer: a point (ordinal, version id or ISO time) and an optional second one to diff with."""

    at: Text | None = None
    diff_from: Text | None = None


class RewardFlowParams(_Params):
    policy: Text | None = None


class DeadLetterParams(_Params):
    stage: Literal["DECODE", "SCHEMA", "VALIDATE", "PROCESS"] | None = None


class ExplainParams(_Params):
    revision: int | None = Field(default=None, ge=1, le=1_000_000)
