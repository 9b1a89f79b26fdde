"""`treadle console`: serve the console until interrupted, on loopback unless a token guards it."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from topics.settings import Settings
from treadle.console.app import console_app
from treadle.console.auth import check_bind

log = logging.getLogger(__name__)


async def serve(settings: Settings, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run the console on host:port until cancelled; UnsafeBindError before binding anything unsafe."""
    token = settings.console_token.get_secret_value() if settings.console_token is not None else None
    check_bind(host, token)
    runner = web.AppRunner(console_app(settings), access_log=None)  # no access log: a ?token= URL is never logged
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.warning("treadle console on http://%s:%d/%s", host, port, "  (token required)" if token else "")
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_console(settings: Settings, host: str, port: int) -> None:
    check_bind(host, settings.console_token.get_secret_value() if settings.console_token is not None else None)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, host, port))
