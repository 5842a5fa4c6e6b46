"""Links to route nodes: JSON calls over aiohttp, and a session's WebSocket step link and reply link.

Every call here is a coroutine on the caller's event loop; failures are RouteErrors that name the node
(``hop_timeout`` when it did not answer in time, ``hop_failed`` when its connection failed, else the node's
own error code and status).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from ..net.auth import auth_headers
from ..protocol.link import decode_reply, frame_key

JSON = "application/json"
FRAME = "application/octet-stream"
NO_LINKS = (404, 405)  # a node that answers the link upgrade so has no links: steps go as POST /v1/step
ERROR_TEXT_CHARS = 200  # how much of a non-JSON error body a RouteError quotes
LINK_TIMEOUTS = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=0.1)  # replies wait per step; a close waits 0.1 s


class RouteError(RuntimeError):
    """A route operation failed. ``status``: HTTP status to pass on; ``code``: protocol error code;
    ``hop``: URL of the node that failed (the message names it too); ``late``: it came back along the route
    for an earlier step the head had already answered (the route is broken; the step now waiting was not
    lost on its own connection, so it is not resent as is); ``next_hop``: at an open, the URL of the node ``hop``
    was asked to pass steps on to (``next_hop_unknown`` refuses that one, not ``hop``)."""

    def __init__(self, message: str, status: int = 502, code: str = "hop_failed", hop: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.hop = hop
        self.late = False
        self.next_hop: str | None = None


# Errors that mean a node of the route is gone or lost the session: a repair can replace it.
# node_banned: the gateway's verifier caught a node of the route lying (gateway/verify.py); the route is repaired
# around it with every node's KV rolled back to 0 (what came after it was computed from its outputs)
REPAIRABLE = frozenset({"hop_failed", "hop_timeout", "internal", "unknown_session", "node_banned"})
BANNED = "node_banned"


def new_http_session() -> aiohttp.ClientSession:
    """An aiohttp session for route traffic on the running loop: no cap on connections (each route session
    holds one or two WebSockets), Nagle off (aiohttp's default), no cookies. Close it when done."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar())


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it looks like ``http://HOST:PORT``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"node URL must look like http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


def timed_out(url: str, timeout: float) -> RouteError:
    """The RouteError for node ``url`` not answering within ``timeout`` s (504 ``hop_timeout``)."""
    return RouteError(f"node {url} did not answer within {timeout:g} s", 504, "hop_timeout", url)


def failed(url: str, exc: BaseException, what: str = "") -> RouteError:
    """The RouteError for node ``url``'s connection failing with ``exc`` (502 ``hop_failed``)."""
    return RouteError(f"node {url} failed: {what}{type(exc).__name__}: {exc}", 502, "hop_failed", url)


async def request(
    http: aiohttp.ClientSession,
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = JSON,
    *,
    token: str | None,
    timeout: float,
) -> tuple[int, bytes]:
    """One HTTP request to node ``url``: (status, body bytes). RouteError when it fails or takes over
    ``timeout`` s; ValueError for a URL that is not ``http://HOST:PORT``."""
    check_url(url)
    headers = auth_headers(token)
    if body is not None:
        headers["Content-Type"] = content_type
    try:
        async with http.request(
            method, url + path, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return resp.status, await resp.read()
    except TimeoutError:
        raise timed_out(url, timeout) from None
    except (OSError, aiohttp.ClientError) as exc:
        raise failed(url, exc) from None


async def call(
    http: aiohttp.ClientSession,
    url: str,
    method: str,
    path: str,
    body: dict | None,
    what: str,
    *,
    token: str | None,
    timeout: float,
) -> dict:
    """A JSON call to node ``url``: its JSON object reply; RouteError (``check_reply``) on any failure."""
    data = json.dumps(body).encode() if body is not None else None
    return check_reply(url, *await request(http, url, method, path, data, token=token, timeout=timeout), what)


def check_reply(url: str, status: int, body: bytes, what: str) -> dict:
    """Node ``url``'s JSON object reply ``body`` to ``what``; RouteError for an error status or a body that is
    no JSON object. An error a later node caused (its ``hop`` in the error body) names that node first:
    "what: node B (via node A): message"; the node's own: "what on node A: message"."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if status >= 400 or not isinstance(data, dict):
        err = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        message = err.get("message") or body[:ERROR_TEXT_CHARS].decode(errors="replace")
        code = err.get("code", "hop_failed")
        hop = err.get("hop") if isinstance(err.get("hop"), str) and err.get("hop") else url
        if url in message:
            text = message
        elif hop != url:  # a later node's error passed back: that node first
            text = f"{what}: node {hop} (via node {url}): {message}"
        else:
            text = f"{what} on node {url}: {message}"
        raise RouteError(text, status if status >= 400 else 502, code, hop)
    return data


@dataclass(eq=False)
class StepLink:
    """A WebSocket to a node's ``GET /v1/link`` (docs/protocol.md, "Links"): each step frame goes as one binary
    message and its reply comes back as one (protocol/link.py). A reader task takes every reply and resolves
    the waiter registered for its frame key; a reply nobody waits for goes to ``late(key, status, body)``.

    ``replies``: a session id makes this that session's *reply link* to the head (``?replies=``, and ``key``, the
    session's reply key, as ``&key=``; it sends only ring grants, ``send_text``): it resolves a waiter shared with
    the step link only with a successful (200) reply, and one of its ``own`` (a ring step's, which only the head
    answers) with any. A node that answers the
    upgrade with 404/405 has no links: steps then go as ``POST /v1/step`` (``http_only``). ``token``: the swarm
    token. Waiters resolve to ``(status, body, direct)``, ``direct`` true on a reply link; when the link fails,
    a step link's waiters and a reply link's own get RouteError ``hop_failed`` (a reply link's others are left to
    the step link).
    """

    http: aiohttp.ClientSession
    url: str
    timeout: float
    token: str | None = None
    replies: uuid.UUID | None = None
    key: str | None = None  # a reply link's key (the session's reply_key)
    late: Callable[[bytes, int, bytes], None] | None = None
    http_only: bool = field(default=False, init=False)
    _ws: aiohttp.ClientWebSocketResponse | None = field(default=None, init=False, repr=False)
    _reader: asyncio.Task | None = field(default=None, init=False, repr=False)
    _waiting: dict[bytes, asyncio.Future] = field(default_factory=dict, init=False, repr=False)
    _own: set[bytes] = field(default_factory=set, init=False, repr=False)

    @property
    def connected(self) -> bool:
        """Whether the WebSocket is open (False before ``connect``, after a failure or ``close``, and without
        links)."""
        return self._ws is not None and not self._ws.closed

    async def connect(self) -> None:
        """Open the WebSocket, or note that the node has no links (``http_only``). RouteError when the node
        refuses the upgrade otherwise or cannot be reached within the link's timeout."""
        parts = urlsplit(self.url)
        path = "/v1/link" + (f"?replies={self.replies}" if self.replies is not None else "")
        if self.replies is not None and self.key is not None:
            path += f"&key={self.key}"
        try:
            async with asyncio.timeout(self.timeout):
                self._ws = await self.http.ws_connect(
                    f"ws://{parts.netloc}{path}",
                    headers=auth_headers(self.token),
                    timeout=LINK_TIMEOUTS,
                    autoping=True,
                    max_msg_size=0,
                )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in NO_LINKS:
                self.http_only = True
                return
            raise RouteError(
                f"node {self.url} refused a link: HTTP {exc.status}",
                exc.status if exc.status >= 400 else 502,
                "hop_failed",
                self.url,
            ) from None
        except TimeoutError:
            raise timed_out(self.url, self.timeout) from None
        except (OSError, aiohttp.ClientError) as exc:
            raise failed(self.url, exc, "link ") from None
        self._reader = asyncio.get_running_loop().create_task(self._read(self._ws))

    def expect(self, key: bytes, waiter: asyncio.Future, own: bool = False) -> None:
        """Resolve ``waiter`` with this link's reply to the frame with ``key``; ``own``: only this link answers it
        (see the class docstring)."""
        self._waiting[key] = waiter
        if own:
            self._own.add(key)

    def forget(self, key: bytes) -> None:
        """Stop waiting for the reply to the frame with ``key`` here (another link answered it)."""
        self._waiting.pop(key, None)
        self._own.discard(key)

    async def send_text(self, text: str) -> bool:
        """Send one text message (a reply link's ring grant); False when the link is not open or failed."""
        if not self.connected:
            return False
        try:
            await self._ws.send_str(text)
        except (OSError, aiohttp.ClientError, RuntimeError):
            return False
        return True

    async def send(self, frame: bytes, waiter: asyncio.Future, timeout: float | None = None) -> None:
        """Send one step frame; ``waiter`` gets its reply. Without links the frame goes as ``POST /v1/step``
        and ``waiter`` is resolved before this returns. RouteError when the link cannot be opened or the
        frame not sent (``timeout``: the POST's, default the link's)."""
        timeout = self.timeout if timeout is None else timeout
        if self._ws is not None and self._ws.closed:  # lost since the last step: a fresh connection
            await self.close()
        if self._ws is None and not self.http_only:
            await self.connect()
        if self._ws is None:  # a node without links
            status, body = await request(
                self.http, self.url, "POST", "/v1/step", frame, FRAME, token=self.token, timeout=timeout
            )
            waiter.set_result((status, body, False))
            return
        key = frame_key(frame)
        self._waiting[key] = waiter
        try:
            await self._ws.send_bytes(frame)
        except (OSError, aiohttp.ClientError, RuntimeError) as exc:
            self._waiting.pop(key, None)
            await self.close()
            raise failed(self.url, exc, "link ") from None

    async def step(self, frame: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        """Send one step frame and wait for its reply on this link: (HTTP status, JSON reply bytes).
        RouteError ``hop_timeout`` (504) when none comes within ``timeout`` s (default: the link's; the link is
        closed then), ``hop_failed`` (502) when the connection fails."""
        timeout = self.timeout if timeout is None else timeout
        waiter = asyncio.get_running_loop().create_future()
        await self.send(frame, waiter, timeout)
        try:
            async with asyncio.timeout(timeout):
                status, body, _ = await waiter
        except TimeoutError:
            await self.close()
            raise timed_out(self.url, timeout) from None
        return status, body

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The reader task: every binary message to its waiter (or ``late``) until the link closes."""
        error: BaseException | None = None
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                reply = decode_reply(msg.data)
                if reply is None:
                    continue
                key, status, body = reply
                waiter = self._waiting.pop(key, None)
                own = key in self._own
                self._own.discard(key)
                if waiter is not None and not waiter.done():
                    if self.replies is None or status == 200 or own:
                        waiter.set_result((status, body, self.replies is not None))
                    continue
                if self.late is not None:
                    self.late(key, status, body)
            error = ws.exception()
        except (OSError, aiohttp.ClientError) as exc:
            error = exc
        finally:
            self._lost(error or ConnectionResetError("link closed"))

    def _lost(self, error: BaseException) -> None:
        """The connection ended: a step link's waiters fail (``hop_failed``), a reply link's own too, its others are
        dropped."""
        waiting, self._waiting = self._waiting, {}
        own, self._own = self._own, set()
        for key, waiter in waiting.items():
            if not waiter.done() and (self.replies is None or key in own):
                waiter.set_exception(failed(self.url, error, "link "))

    async def close(self) -> None:
        """Close the WebSocket (its waiters fail as when it is lost); safe to call twice."""
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            try:
                await ws.close()
            except (OSError, aiohttp.ClientError, RuntimeError):
                pass
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            reader.cancel()
        self._lost(ConnectionResetError("link closed"))
