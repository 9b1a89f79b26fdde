"""Who may open the console: anyone on loopback, or with the token (TREADLE_CONSOLE_TOKEN) anywhere else.

With a token set, every request must carry it: `Authorization: Bearer <token>`, or the cookie that a first visit
with `?token=<token>` sets (HttpOnly, SameSite=Strict), after which the page redirects to the same URL without the
token so it stays out of history and referrers. Tokens are compared in constant time and never logged: the
console's access log is off, and a refusal says only that the token is missing or wrong.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable

from aiohttp import web

COOKIE = "treadle_console"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class UnsafeBindError(ValueError):
    """Binding a non-loopback address without a token; the message is the one line the CLI prints."""


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token."""
    if not is_loopback(host) and not token:
        raise UnsafeBindError(
            f"refusing to serve the console on {host} without a token: set TREADLE_CONSOLE_TOKEN (or bind 127.0.0.1)"
        )


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def token_middleware(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware that lets a request through only with the token (header, cookie or ?token= once)."""

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        bearer = header[7:].strip() if header[:7].lower() == "bearer " else None
        if token_matches(bearer, token) or token_matches(request.cookies.get(COOKIE), token):
            return await handler(request)
        if token_matches(request.query.get("token"), token):
            url = request.rel_url
            clean = url.with_query([(k, v) for k, v in url.query.items() if k != "token"])
            response = web.HTTPSeeOther(str(clean))
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
            raise response
        raise web.HTTPUnauthorized(
            text="401: this console needs its token (Authorization: Bearer <token>, or open it once with ?token=)",
            headers={"WWW-Authenticate": 'Bearer realm="treadle console"'},
        )

    return require_token
