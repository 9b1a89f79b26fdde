"""The console's routes: one aiohttp application, server-side Jinja2 templates, assets from the package.

Every page reads through the SQL service (treadle.console.queries) off the event loop, so a slow query never
stalls the live streams of other pages. A page with `?fragment=1` answers only its live part, which the page's
script swaps in when the live stream says it changed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from sinks.sql_client import QueryFailedError
from sinks.sql_guard import ReadOnlyQueryError
from sinks.sql_params import QueryParameterError
from topics.settings import Settings
from treadle.console import pages, queries, svg
from treadle.console.auth import token_middleware
from treadle.console.events import RECORD_TYPES, EventChecker, example_event
from treadle.console.live import stream_changes
from treadle.console.params import (
    BadRequestError,
    DeadLetterParams,
    ExplainParams,
    RewardFlowParams,
    SessionFilter,
    SessionRef,
    StateParams,
)
from treadle.console.queries import SqlReader

HERE = Path(__file__).parent
SETTINGS_KEY = web.AppKey("settings", Settings)
READER_KEY = web.AppKey("reader", SqlReader)
CHECKER_KEY = web.AppKey("checker", EventChecker)
TEMPLATES_KEY = web.AppKey("templates", jinja2.Environment)
LIVE_INTERVAL_KEY = web.AppKey("live_interval", float)


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["iso"] = pages.iso
    env.filters["seconds"] = lambda v: "" if v is None else svg.seconds(float(v))
    env.filters["num"] = lambda v, digits=4: "" if v is None else f"{float(v):.{digits}g}"
    env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, default=str, sort_keys=True)
    return env


def render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    page = request.app[TEMPLATES_KEY].get_template(name).render(request=request, **context)
    return web.Response(text=page, content_type="text/html", status=status)


def _fragment(request: web.Request) -> bool:
    return request.query.get("fragment") == "1"


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(queries.one_at_a_time, fn, *args)


@web.middleware
async def readable_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A refused filter or a query the SQL service rejected becomes a page saying so, never a traceback."""
    try:
        return await handler(request)
    except (BadRequestError, QueryParameterError) as exc:
        return render(request, "error.html", status=400, title="bad request", message=str(exc))
    except (QueryFailedError, ReadOnlyQueryError) as exc:
        return render(request, "error.html", status=503, title="SQL service", message=str(exc).splitlines()[0])


async def index(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/sessions")


async def sessions(request: web.Request) -> web.Response:
    f = SessionFilter.parse(request.query)
    reader = request.app[READER_KEY]
    view = await _in_thread(pages.sessions_page, reader, f, not _fragment(request))
    name = "sessions_table.html" if _fragment(request) else "sessions.html"
    return render(request, name, view=view, f=f, title="sessions")


async def timeline(request: web.Request) -> web.Response:
    session = SessionRef.parse({"session": request.match_info["session"]}).session
    settings, reader = request.app[SETTINGS_KEY], request.app[READER_KEY]
    view = await _in_thread(pages.timeline_page, reader, session, pages.reward_policy(settings))
    name = "timeline_body.html" if _fragment(request) else "timeline.html"
    return render(request, name, view=view, title=f"session {session}")


async def step(request: web.Request) -> web.Response:
    lid = SessionRef.parse({"session": request.match_info["lid"]}).session
    p = ExplainParams.parse(request.query)
    explanation, error = await _in_thread(pages.explanation_page, request.app[SETTINGS_KEY], lid, p.revision)
    as_json = None if explanation is None else explanation.as_json()
    labels = {} if explanation is None else {c.event_id: f"{c.source}/{c.name}" for c in explanation.components}
    return render(request, "step.html", lid=lid, e=explanation, error=error, as_json=as_json, labels=labels,
                  title=f"step {lid}")  # fmt: skip


async def state(request: web.Request) -> web.Response:
    session = SessionRef.parse({"session": request.match_info["session"]}).session
    p = StateParams.parse(request.query)
    view = await _in_thread(pages.state_page, request.app[SETTINGS_KEY], request.app[READER_KEY], session, p)
    return render(request, "state.html", view=view, p=p, title=f"state of {session}")


async def rewards(request: web.Request) -> web.Response:
    p = RewardFlowParams.parse(request.query)
    settings = request.app[SETTINGS_KEY]
    flows, versions = await _in_thread(
        pages.reward_flow_page, request.app[READER_KEY], p, pages.reward_policy(settings)
    )
    return render(request, "rewards.html", flows=flows, versions=versions, p=p, title="reward flow")


async def dead_letters(request: web.Request) -> web.Response:
    p = DeadLetterParams.parse(request.query)
    groups, rows = await _in_thread(pages.dead_letters_page, request.app[READER_KEY], p, request.app[CHECKER_KEY])
    return render(request, "dead_letters.html", groups=groups, rows=rows, p=p, title="dead letters")


async def validate_form(request: web.Request) -> web.Response:
    record_type = request.query.get("type", "RewardSignal")
    if record_type not in RECORD_TYPES:
        record_type = "RewardSignal"
    return render(request, "validate.html", types=list(RECORD_TYPES), record_type=record_type,
                  event=example_event(record_type), key="", verdict=None, title="schema validator")  # fmt: skip


async def validate_submit(request: web.Request) -> web.Response:
    form = await request.post()
    record_type = str(form.get("type", ""))
    event, key = str(form.get("event", "")), str(form.get("key", ""))
    if len(event) > 1_000_000:
        raise BadRequestError("event: at most 1 MB")
    verdict = request.app[CHECKER_KEY].check(record_type, event, key or None)
    return render(request, "validate.html", types=list(RECORD_TYPES), record_type=record_type, event=event,
                  key=key, verdict=verdict, title="schema validator")  # fmt: skip


async def live_sessions(request: web.Request) -> web.StreamResponse:
    reader = request.app[READER_KEY]
    return await stream_changes(request, lambda: queries.sessions_fingerprint(reader), request.app[LIVE_INTERVAL_KEY])


async def live_session(request: web.Request) -> web.StreamResponse:
    session = SessionRef.parse({"session": request.match_info["session"]}).session
    reader = request.app[READER_KEY]
    return await stream_changes(
        request, lambda: queries.session_fingerprint(reader, session), request.app[LIVE_INTERVAL_KEY]
    )


@web.middleware
async def security_headers(request: web.Request, handler: Any) -> web.StreamResponse:
    """No inline scripts or third-party assets: everything the pages load comes from /static."""
    response = await handler(request)
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'",
    )
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    return response


def console_app(settings: Settings, reader: SqlReader | None = None, live_interval: float = 1.0) -> web.Application:
    """The console as an aiohttp application; with a token setting, every route (assets too) requires it."""
    middlewares: list[Any] = []
    if settings.console_token is not None:
        middlewares.append(token_middleware(settings.console_token.get_secret_value()))
    middlewares += [security_headers, readable_errors]
    app = web.Application(middlewares=middlewares, client_max_size=2 * 1024 * 1024)
    app[SETTINGS_KEY] = settings
    app[READER_KEY] = reader or SqlReader(settings)
    app[CHECKER_KEY] = EventChecker(settings)
    app[TEMPLATES_KEY] = templates()
    app[LIVE_INTERVAL_KEY] = live_interval
    app.router.add_get("/", index)
    app.router.add_get("/sessions", sessions)
    app.router.add_get("/sessions/{session}", timeline)
    app.router.add_get("/sessions/{session}/state", state)
    app.router.add_get("/steps/{lid}", step)
    app.router.add_get("/rewards", rewards)
    app.router.add_get("/dead-letters", dead_letters)
    app.router.add_get("/validate", validate_form)
    app.router.add_post("/validate", validate_submit)
    app.router.add_get("/live/sessions", live_sessions)
    app.router.add_get("/live/sessions/{session}", live_session)
    app.router.add_static("/static", HERE / "static", follow_symlinks=False)
    return app
