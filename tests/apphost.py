"""``with AppThread(factory) as url`` serves an aiohttp app on a free loopback port in a background thread."""

from __future__ import annotations

import contextlib

from ggufswarm.net.http import ServerThread


@contextlib.contextmanager
def AppThread(app_factory):
    server = ServerThread(app_factory())
    try:
        yield server.start()
    finally:
        server.stop()
