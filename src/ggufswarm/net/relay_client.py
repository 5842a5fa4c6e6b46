"""The unreachable node's end of a relay (net/relay.py has the wire format and the relay's end): one outbound
websocket to a relay, whose public port forwards to this node's local HTTP port, re-attached when it drops."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from .auth import auth_headers
from .relay import (
    ATTACH_PATH,
    ATTACH_TIMEOUT_S,
    HEARTBEAT_S,
    MAX_MSG,
    STABLE_S,
    RelayError,
    _Counters,
    _Mux,
    _Stream,
)

log = logging.getLogger(__name__)


class RelayClient:
    """The unreachable node's end: one outbound websocket to a relay, whose public port forwards to
    ``local_host:local_port``. ``start()`` attaches; a background task re-attaches with backoff
    (``min_backoff_s`` doubling to ``max_backoff_s``) when the websocket drops, calling ``on_address(host,
    port)`` (a function or coroutine function) whenever the public address changes. ``bytes_in``: bytes
    carried from the relay's public port to the local port; ``bytes_out``: bytes sent back."""

    def __init__(
        self,
        relay_url: str,
        local_port: int,
        token: str | None,
        on_address: Callable[[str, int], object] | None = None,
        *,
        local_host: str = "127.0.0.1",
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ):
        url, sep, query = relay_url.partition("?")  # http://HOST:PORT, or the attach URL itself; a query is kept
        url = url.rstrip("/")
        self.url = (url if url.endswith(ATTACH_PATH) else url + ATTACH_PATH) + sep + query
        self.local_host, self.local_port, self.token = local_host, local_port, token
        self.on_address = on_address
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.address: tuple[str, int] | None = None
        self.attached = False
        self.counters = _Counters()
        self._session: aiohttp.ClientSession | None = None
        self._mux: _Mux | None = None
        self._task: asyncio.Task | None = None
        self._remotes: dict[int, str] = {}  # local source port of a carried connection -> the address it came from

    @property
    def bytes_in(self) -> int:
        return self.counters.rx

    @property
    def bytes_out(self) -> int:
        return self.counters.tx

    @property
    def streams(self) -> int:
        """Connections carried right now."""
        return len(self._mux.streams) if self._mux is not None and self.attached else 0

    async def start(self, session: aiohttp.ClientSession, timeout: float = ATTACH_TIMEOUT_S) -> tuple[str, int]:
        """Attach (within ``timeout`` s) and keep attached in the background; returns the public ``(host,
        port)``. Raises RelayError when the relay cannot be reached, refuses (token, full, no relay there) or
        answers something else than an address."""
        self._session = session
        ws, self.address = await self._attach(timeout)
        self._task = asyncio.create_task(self._keep(ws))
        return self.address

    async def _attach(self, timeout: float) -> tuple[aiohttp.ClientWebSocketResponse, tuple[str, int]]:
        try:
            ws = await asyncio.wait_for(
                self._session.ws_connect(
                    self.url,
                    headers=auth_headers(self.token),
                    compress=0,
                    max_msg_size=MAX_MSG,
                    heartbeat=HEARTBEAT_S,
                    autoping=True,
                ),
                timeout,
            )
        except aiohttp.WSServerHandshakeError as exc:
            why = {
                401: "refused the swarm token (--token)",
                404: "has no relay (start it with --relay)",
                503: "is full",
            }.get(exc.status, f"refused the attach: HTTP {exc.status}")
            raise RelayError(f"relay {self.url} {why}") from None
        except TimeoutError:
            raise RelayError(f"relay {self.url} did not answer within {timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RelayError(f"cannot reach relay {self.url}: {type(exc).__name__}: {exc}") from None
        try:
            msg = await ws.receive(timeout=timeout)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise ValueError(f"a {msg.type.name} message")
            addr = json.loads(msg.data)
            host, port = addr["host"], addr["port"]
            if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"{addr!r}")
        except (ValueError, KeyError, TypeError, TimeoutError) as exc:
            await ws.close()
            raise RelayError(f"relay {self.url} gave no address: {type(exc).__name__}: {exc}") from None
        self.attached = True
        return ws, (host, port)

    async def _keep(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        delay = self.min_backoff_s
        while True:
            began = time.monotonic()
            self._mux = _Mux(ws, self.counters, f"to {self.url}", accept_open=True)
            self._mux.connect = self._connect_local
            self._mux.on_closed = lambda st: self._remotes.pop(st.local_port, None)
            await self._mux.serve()
            self.attached = False
            if time.monotonic() - began > STABLE_S:
                delay = self.min_backoff_s
            log.warning("relay %s: attachment lost; re-attaching", self.url)
            while True:
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.max_backoff_s)
                try:
                    ws, addr = await self._attach(ATTACH_TIMEOUT_S)
                    break
                except RelayError as exc:
                    log.warning("%s; retrying", exc)
            log.info("relay %s: re-attached at %s:%d", self.url, *addr)
            if addr != self.address:
                self.address = addr
                if self.on_address is not None:
                    try:
                        result = self.on_address(*addr)
                        if inspect.isawaitable(result):
                            await result
                    except Exception:
                        log.exception("relay %s: on_address failed", self.url)

    async def _connect_local(self, st: _Stream):
        reader, writer = await asyncio.open_connection(self.local_host, self.local_port)
        st.local_port = writer.get_extra_info("sockname")[1]
        self._remotes[st.local_port] = st.remote  # forgotten when the stream ends (_Mux.on_closed)
        return reader, writer

    def remote_of(self, port: int) -> str | None:
        """The address a carried connection came from, given the local source port it reaches this node's server
        from; ``""`` when the relay did not say; None when no carried connection uses that port (a local one)."""
        return self._remotes.get(port)

    async def close(self) -> None:
        """Detach: the relay closes the public port and its connections."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._mux is not None:
            self._mux.shutdown()
            await self._mux.ws.close()
        self.attached = False


__all__ = ["RelayClient"]
