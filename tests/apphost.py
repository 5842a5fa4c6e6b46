"""Run an aiohttp app on a free loopback port in a background thread (for peers that need a real socket)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class AppThread:
    """``with AppThread(app) as url: ...`` serves ``app`` at ``url`` (http://127.0.0.1:PORT) until exit."""

    def __init__(self, app_factory):
        self.app_factory = app_factory
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app_factory())
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def __enter__(self) -> str:
        self._thread.start()
        self._started.wait(30)
        return self.url

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
