"""Frame links: the one WebSocket link to a node's ``GET /v1/link`` that the client (its step link to a route's
first node, its reply link to the head) and every node (to its next hops) send step frames on, with the plain
``POST /v1/step`` for a node without links; every failure is a RouteError naming the node. docs/protocol.md,
"Links" and "Reply link"; the per-token path: docs/design.md."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from ..protocol.errors import ERROR_STATUS, RouteError
from ..protocol.link import decode_reply, frame_key
from .auth import auth_headers

FRAME = "application/octet-stream"
NO_LINKS = (404, 405)  # a node that answers the link upgrade so has no links: steps go as POST /v1/step
LINK_TIMEOUTS = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=0.1)  # replies wait per step; a close waits 0.1 s
MAX_HOP_MESSAGE_CHARS = 2000  # a next hop's error message is passed on cut to this
SEND_ERRORS = (OSError, aiohttp.ClientError, RuntimeError)  # what writing to a closing WebSocket raises


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError unless it looks like ``http://HOST:PORT``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"node URL must look like http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


def timed_out(url: str, timeout: float) -> RouteError:
    """The RouteError for node ``url`` not answering within ``timeout`` s (504 ``hop_timeout``)."""
    return RouteError("hop_timeout", f"node {url} did not answer within {timeout:g} s", 504, url)


def failed(url: str, exc: BaseException, what: str = "") -> RouteError:
    """The RouteError for node ``url``'s connection failing with ``exc`` (502 ``hop_failed``)."""
    return RouteError("hop_failed", f"node {url} failed: {what}{type(exc).__name__}: {exc}", 502, url)


def reply_error(body: bytes, status: int, url: str) -> RouteError:
    """A node's view of its next hop ``url``'s error reply (``status`` >= 400, JSON ``{"error": ...}``): that code
    and message, passed on; ``hop``: the node a deeper hop named, else ``url``. A body that is no protocol error is
    never passed on (the next hop may not be a node at all): ``hop_failed`` saying so."""
    try:
        err = json.loads(body)["error"]
        code, message, hop = str(err["code"]), str(err["message"])[:MAX_HOP_MESSAGE_CHARS], err.get("hop")
        if code not in ERROR_STATUS or (hop is not None and not isinstance(hop, str)):
            raise ValueError("not a protocol error")
    except (ValueError, KeyError, TypeError, AttributeError):
        code, hop = "hop_failed", None
        message = f"answered {status} with {len(body)} bytes that are not a protocol error"
    return RouteError(code, f"next hop {url}: {message}", status, hop or url)


async def request(
    http: aiohttp.ClientSession,
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    content_type: str = "application/json",
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


class FrameLink:
    """A WebSocket to node ``url``'s ``GET /v1/link``: each step frame goes as one binary message and its reply
    comes back as one (protocol/link.py). A reader task resolves the waiter registered for each reply's frame key
    with ``(status, body, direct)`` (``direct``: it came on a reply link); a reply nobody waits for goes to
    ``late(key, status, body)``. Opened on first use and again after it closed; a node that answers the upgrade with
    404/405 has no links, and each frame then goes as ``POST /v1/step`` (``http_only``).

    ``replies``: a session id makes this that session's *reply link* to the head (``?replies=``, and ``key``, the
    session's reply key, as ``&key=``; it sends only ring grants, ``send_text``): it resolves a waiter shared with
    the step link only with a successful (200) reply, and one of its ``own`` (a ring step's, which only the head
    answers) with any, and passes the head's text messages (answers to grants) to ``text``. When the link fails,
    its waiters (a reply link's own only) get RouteError ``hop_failed``.
    ``http``: the aiohttp session to connect with; ``token``: the swarm token (None: ``http`` carries it, or an open
    swarm); ``timeout``: seconds to open the link, and a step's default.
    """

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        timeout: float,
        token: str | None = None,
        *,
        replies: uuid.UUID | None = None,
        key: str | None = None,
        late: Callable[[bytes, int, bytes], None] | None = None,
        text: Callable[[str], None] | None = None,
    ):
        self.http = http
        self.url = url
        self.timeout = timeout
        self.token = token
        self.replies = replies
        self.key = key
        self.late = late
        self.text = text
        self.http_only = False
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._connecting: asyncio.Future | None = None
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._own: set[bytes] = set()

    @property
    def connected(self) -> bool:
        """Whether the WebSocket is open (False before ``connect``, after a failure or ``close``, and without
        links)."""
        return self._ws is not None and not self._ws.closed

    async def connect(self, timeout: float | None = None) -> None:
        """Open the WebSocket (callers at the same time share one attempt), or note that the node has no links
        (``http_only``). RouteError when the node refuses the upgrade otherwise or cannot be reached within
        ``timeout`` s (default: the link's)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect(self.timeout if timeout is None else timeout))
            self._connecting.add_done_callback(self._connected)
        await asyncio.shield(self._connecting)

    def _connected(self, fut: asyncio.Future) -> None:
        self._connecting = None
        if not fut.cancelled():
            fut.exception()  # retrieved: its awaiters raise it

    async def _connect(self, timeout: float) -> None:
        parts = urlsplit(self.url)
        path = "/v1/link" + (f"?replies={self.replies}" if self.replies is not None else "")
        if self.replies is not None and self.key is not None:
            path += f"&key={self.key}"
        try:
            async with asyncio.timeout(timeout):
                ws = await self.http.ws_connect(
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
                "hop_failed", f"node {self.url} refused a link: HTTP {exc.status}", 502, self.url
            ) from None
        except TimeoutError:
            raise timed_out(self.url, timeout) from None
        except (OSError, aiohttp.ClientError) as exc:
            raise failed(self.url, exc, "link ") from None
        self._ws = ws
        self._reader = asyncio.get_running_loop().create_task(self._read(ws))

    def expect(self, key: bytes, waiter: asyncio.Future, own: bool = False) -> None:
        """Resolve ``waiter`` with this link's reply to the frame with ``key``; ``own``: only this link answers it
        (see the class docstring)."""
        self._waiting[key] = waiter
        if own:
            self._own.add(key)

    @property
    def awaited(self) -> int:
        """Replies this link waits for now."""
        return len(self._waiting)

    def forget(self, key: bytes, waiter: asyncio.Future | None = None) -> None:
        """Stop waiting for the reply to the frame with ``key`` here (another link answered it, or it timed out);
        ``waiter``: only while that is the one waiting (not one a later send of the same frame registered)."""
        if waiter is None or self._waiting.get(key) is waiter:
            self._waiting.pop(key, None)
            self._own.discard(key)

    async def send_text(self, text: str) -> bool:
        """Send one text message (a reply link's ring grant); False when the link is not open or failed."""
        if not self.connected:
            return False
        try:
            await self._ws.send_str(text)
        except SEND_ERRORS:
            return False
        return True

    async def post(self, frame: bytes, timeout: float | None = None) -> tuple[int, bytes, bool]:
        """Send one step frame as ``POST /v1/step`` and wait for its reply: ``(status, body, False)``. RouteError
        ``hop_timeout`` / ``hop_failed``."""
        timeout = self.timeout if timeout is None else timeout
        status, body = await request(
            self.http, self.url, "POST", "/v1/step", frame, FRAME, token=self.token, timeout=timeout
        )
        return status, body, False

    async def send(self, frame: bytes, waiter: asyncio.Future, timeout: float | None = None) -> bool:
        """Send one step frame; ``waiter`` gets its reply. Over the link the frame has been written when this returns
        (frames sent one after another reach the node in that order: True); without links it goes as
        ``POST /v1/step`` and ``waiter`` is resolved before this returns (False). RouteError when the link cannot
        be opened or the frame not sent (``timeout``: to open the link or for the POST; default the link's)."""
        if self._ws is not None and self._ws.closed:  # lost since the last step: a fresh connection
            await self.close()
        if self._ws is None and not self.http_only:
            await self.connect(timeout)
        if self._ws is None:  # a node without links
            waiter.set_result(await self.post(frame, timeout))
            return False
        key = frame_key(frame)
        self._waiting[key] = waiter
        try:
            await self._ws.send_bytes(frame)
        except SEND_ERRORS as exc:
            self._waiting.pop(key, None)
            await self.close()
            raise failed(self.url, exc, "link ") from None
        return True

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
                    if msg.type == aiohttp.WSMsgType.TEXT and self.text is not None:
                        self.text(msg.data)
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
        """Close the WebSocket (its waiters fail as when it is lost); safe to call twice. The next ``send`` opens a
        new one."""
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            try:
                await ws.close()
            except SEND_ERRORS:
                pass
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done() and reader is not asyncio.current_task():
            reader.cancel()
        self._lost(ConnectionResetError("link closed"))


class LinkPool:
    """A node's frame links, one per next-hop URL (every session going there shares it), opened on first use.
    ``client``: returns the node's aiohttp session (it carries the swarm token header)."""

    def __init__(self, client: Callable[[], aiohttp.ClientSession]):
        self._client = client
        self._links: dict[str, FrameLink] = {}

    async def send(self, url: str, frame: bytes, timeout_s: float, quiet: bool = False) -> tuple[asyncio.Future, bool]:
        """Send one step frame to ``url``: (the future of its reply — ``(status, body, False)`` as ``POST
        url/v1/step`` would answer, or RouteError ``hop_timeout`` / ``hop_failed`` naming ``url`` — within
        ``timeout_s`` seconds of now; whether it went over a link). Over a link the frame has been written when this
        returns, so frames sent one after another reach the hop in that order; a hop without links gets a
        ``POST /v1/step`` that is under way (not ordered). RouteError when the link cannot be opened or written.
        ``quiet``: a quiet step (FLAG_QUIET), which a node on a link answers only when it fails: over a link its
        future resolves with None when no answer came within ``timeout_s`` (the step went on), or the caller
        resolves it so when it knows the step went through."""
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = FrameLink(self._client(), url, timeout_s)
        loop = asyncio.get_running_loop()
        if link.http_only:
            return asyncio.ensure_future(link.post(frame, timeout_s)), False
        waiter = loop.create_future()
        if not await link.send(frame, waiter, timeout_s):
            return waiter, False
        key = frame_key(frame)

        def expire() -> None:
            if not waiter.done():
                link.forget(key)
                if quiet:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(timed_out(url, timeout_s))

        timer = loop.call_later(timeout_s, expire)
        waiter.add_done_callback(lambda _f: timer.cancel())
        if quiet:  # settled by its caller (the step went through): the link stops waiting for it
            waiter.add_done_callback(lambda _f: link.forget(key, waiter))
        return waiter, True

    def ready(self, url: str) -> bool:
        """Whether a frame to ``url`` goes out without first opening a link (one is open, or the node takes
        ``POST /v1/step`` only)."""
        link = self._links.get(url)
        return link is not None and (link.connected or link.http_only)

    def linked(self, url: str) -> bool:
        """Whether a link to ``url`` is open (not a node reached by ``POST /v1/step``)."""
        link = self._links.get(url)
        return link is not None and link.connected

    def counts(self) -> dict:
        """``{"out": links open, "http_only": next hops reached by POST /v1/step, "awaited": replies awaited on the
        links}`` (for /health)."""
        return {
            "out": sum(1 for link in self._links.values() if link.connected),
            "http_only": sum(1 for link in self._links.values() if link.http_only),
            "awaited": sum(link.awaited for link in self._links.values()),
        }

    async def close(self) -> None:
        """Close every link (their waiters get hop_failed)."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()
