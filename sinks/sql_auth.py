"""Who may read through the sink's SQL endpoint: loopback callers, and anyone else only with TREADLE_SQL_TOKEN.

The endpoint answers any read-only query over every table, so exposing it beyond the machine without a secret
would publish the data. `check_sql_bind` refuses that combination before anything binds; `token_middleware`
checks the token on every /sql and /arrow request (constant-time compare). /metrics stays open: Prometheus
scrapes it and it carries counts, not rows. The token is compared and sent, never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

from topics.settings import Settings

OPEN_PATHS = frozenset({"/metrics"})


class SqlExposureError(Exception):
    """The SQL endpoint would listen beyond this machine without a token; the message says what to set."""


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) binds only this machine; an unresolvable name counts as not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_sql_bind(settings: Settings) -> None:
    """Raise SqlExposureError when the endpoint would serve SQL on a non-loopback address without a token."""
    if settings.sql_token is None and not is_loopback(settings.bind_host):
        raise SqlExposureError(
            f"the SQL endpoint would listen on TREADLE_BIND_HOST={settings.bind_host} without a token: set "
            "TREADLE_SQL_TOKEN (every reader then sends it), or bind 127.0.0.1"
        )


def bearer(settings: Settings) -> dict[str, str]:
    """The request header that carries the token, or none when no token is set."""
    if settings.sql_token is None:
        return {}
    return {"Authorization": f"Bearer {settings.sql_token.get_secret_value()}"}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def token_middleware(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware answering 401 to a request for SQL that lacks `token` or carries another one."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            sent = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(sent, expected):
                return web.json_response(
                    {"error": "the SQL endpoint wants TREADLE_SQL_TOKEN: set it to the sink's token"}, status=401
                )
        return await handler(request)

    return check_token
