"""The one background event loop that blocking callers (the CLI, tests, benches) run route coroutines on.

``run(coro)`` submits a coroutine to it and waits; ``shared_http()`` is the aiohttp session every blocking route
session shares (one connection pool per process). The loop thread is a daemon started on first use; uvloop's
loop when installed (as the servers', net/http.py), asyncio's otherwise.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp

from .transport import new_http_session

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_http: aiohttp.ClientSession | None = None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def background_loop() -> asyncio.AbstractEventLoop:
    """The shared loop, started (in its daemon thread ``route-loop``) on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = _new_loop()
            _thread = threading.Thread(target=loop.run_forever, name="route-loop", daemon=True)
            _thread.start()
            _loop = loop
            atexit.register(_close_http)
        return _loop


def run(coro: Awaitable[T]) -> T:
    """Run ``coro`` on the shared loop and return its result (or raise its exception) in the calling thread.
    RuntimeError when called on the loop's own thread (it would wait for itself)."""
    loop = background_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("a blocking route call on the route loop itself: await the async API there")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def shared_http() -> aiohttp.ClientSession:
    """The aiohttp session of the shared loop (call it on that loop), created on first use."""
    global _http
    if _http is None or _http.closed:
        _http = new_http_session()
    return _http


def _close_http() -> None:
    """At exit: close the shared aiohttp session (no "unclosed session" warning from a collected one)."""
    if _http is not None and not _http.closed and _loop is not None and _loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(_http.close(), _loop).result(timeout=1.0)
        except Exception:
            pass
