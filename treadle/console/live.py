"""Live pages: server-sent events from a short poll of the SQL service.

A page that wants updates opens an EventSource on a `/live/...` URL; the server asks the SQL service for a cheap
fingerprint of what the page shows (row counts, revisions, the newest update) every `interval` seconds and sends
one `changed` event when it moves. The page's few lines of JavaScript then fetch the fragment again and swap it
in. Nothing is pushed from Kafka: the console stays a reader of the tables, like `treadle sql`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from aiohttp import web

from treadle.console.queries import one_at_a_time

Fingerprint = Callable[[], tuple[Any, ...]]


async def stream_changes(request: web.Request, fingerprint: Fingerprint, interval: float,
                         max_seconds: float = 3600.0) -> web.StreamResponse:  # fmt: skip
    """Send `event: changed` whenever `fingerprint()` differs from the last poll; a comment line keeps it open.

    The stream ends after `max_seconds` (the browser's EventSource reconnects by itself) or when the client goes.
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
    await response.prepare(request)
    await response.write(b"retry: 2000\n\n")
    last = await asyncio.to_thread(one_at_a_time, fingerprint)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_seconds
    with contextlib.suppress(ConnectionResetError):  # the browser went away
        while loop.time() < deadline:
            await asyncio.sleep(interval)
            try:
                now = await asyncio.to_thread(one_at_a_time, fingerprint)
            except Exception:  # the sink restarting, say: keep the stream, try again next time
                await response.write(b": waiting for the SQL service\n\n")
                continue
            if now != last:
                last = now
                await response.write(b"event: changed\ndata: " + repr(now).encode() + b"\n\n")
            else:
                await response.write(b": idle\n\n")
    return response
