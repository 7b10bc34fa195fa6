"""Noticing that an HTTP client went away while its answer is still being made.

Shared by the engine's API server and the gateway, which both stop upstream work (engine requests, an
upstream read) for a client nobody is waiting on; it needs nothing but the ASGI request, so either may
import it without importing the other.
"""

from __future__ import annotations

from fastapi import Request


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client goes away. Only for a request whose body is already read: then the next ASGI
    message can only be the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
