"""Hop links: one WebSocket from a node to each next hop, carrying the step frames of every session.

A link sends each frame as one binary WebSocket message (``GET /v1/link`` on the next hop) instead of a whole
``POST /v1/step`` request, and gets one binary reply (protocol/link.py). A next hop without ``/v1/link`` (an older
node, a test double) is remembered and reached by ``POST /v1/step`` instead. The reply format and what a link
saves: docs/protocol.md, "Links"; docs/design.md, "Measured choices"."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import aiohttp

from ..protocol import ProtocolError
from ..protocol.errors import ERROR_STATUS
from ..protocol.link import decode_reply, frame_key

log = logging.getLogger(__name__)

HTTP_ONLY_STATUSES = (404, 405)  # a link handshake answered so: the next hop has no /v1/link
MAX_HOP_MESSAGE_CHARS = 2000  # a next hop's error message is passed on cut to this


def _error(code: str, message: str, hop: str) -> ProtocolError:
    return ProtocolError(code, message, hop=hop)


class _Link:
    """One open WebSocket to a next hop, with the replies it still waits for."""

    def __init__(self, url: str, ws: aiohttp.ClientWebSocketResponse):
        self.url = url
        self.ws = ws
        self.pending: dict[bytes, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    async def read(self, on_close: Callable[[_Link], None]) -> None:
        reason = "closed"
        try:
            async for msg in self.ws:
                reply = decode_reply(msg.data) if msg.type == aiohttp.WSMsgType.BINARY else None
                if reply is None:
                    log.warning("link to %s: unexpected %s message; ignored", self.url, msg.type.name)
                    continue
                key, status, body = reply
                fut = self.pending.get(key)
                if fut is not None and not fut.done():
                    fut.set_result((status, body))
            if self.ws.exception() is not None:
                reason = f"failed: {type(self.ws.exception()).__name__}: {self.ws.exception()}"
        except Exception as exc:
            reason = f"failed: {type(exc).__name__}: {exc}"
        finally:
            on_close(self)
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(_error("hop_failed", f"next hop {self.url} failed: link {reason}", self.url))


class HopLinks:
    """The links of one node, one per next-hop URL, opened on first use and again after one closes.

    ``client``: returns the node's aiohttp ClientSession (it carries the swarm token header).
    """

    def __init__(self, client: Callable[[], aiohttp.ClientSession]):
        self._client = client
        self._links: dict[str, _Link] = {}
        self._opening: dict[str, asyncio.Future] = {}
        self._http_only: set[str] = set()

    async def _link(self, url: str, timeout_s: float) -> _Link | None:
        link = self._links.get(url)
        if link is not None and not link.ws.closed:
            return link
        if url in self._http_only:
            return None
        opening = self._opening.get(url)
        if opening is None:
            opening = self._opening[url] = asyncio.ensure_future(self._open(url, timeout_s))
            opening.add_done_callback(lambda _f: self._opening.pop(url, None))
        return await asyncio.shield(opening)

    async def _open(self, url: str, timeout_s: float) -> _Link | None:
        try:
            ws = await asyncio.wait_for(
                self._client().ws_connect(url + "/v1/link", max_msg_size=0, autoping=True), timeout_s
            )
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in HTTP_ONLY_STATUSES:  # a next hop without links: plain POST /v1/step from now on
                self._http_only.add(url)
                return None
            raise _error("hop_failed", f"next hop {url} refused a link: {exc.status} {exc.message}", url) from None
        except TimeoutError:
            raise _error("hop_timeout", f"next hop {url} did not open a link within {timeout_s:g} s", url) from None
        except aiohttp.ClientError as exc:
            raise _error("hop_failed", f"next hop {url} failed: {type(exc).__name__}: {exc}", url) from None
        link = _Link(url, ws)
        self._links[url] = link
        link.reader = asyncio.create_task(link.read(self._closed))
        return link

    def _closed(self, link: _Link) -> None:
        if self._links.get(link.url) is link:
            del self._links[link.url]

    async def send(self, url: str, frame: bytes, timeout_s: float) -> tuple[asyncio.Future, bool]:
        """Send one step frame to ``url``; (the future of its reply — (HTTP status, JSON body bytes) as
        ``POST url/v1/step`` would answer, or ProtocolError ``hop_timeout`` / ``hop_failed`` naming ``url`` —
        within ``timeout_s`` seconds of now; whether it went over a link). Over a link the frame has been written when
        this returns, so frames sent one after another reach the hop in that order; a hop without links gets a
        ``POST /v1/step`` that is under way (not ordered). Raises ProtocolError when the link cannot be opened or
        written (hop_failed, hop_timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        link = await self._link(url, timeout_s)
        if link is None:
            return asyncio.ensure_future(self._post(url, frame, timeout_s)), False
        key = frame_key(frame)
        fut = link.pending[key] = loop.create_future()
        try:
            await link.ws.send_bytes(frame)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            if link.pending.get(key) is fut:
                del link.pending[key]
            raise _error("hop_failed", f"next hop {url} failed: {type(exc).__name__}: {exc}", url) from None
        return asyncio.ensure_future(self._reply(link, key, fut, deadline, url, timeout_s)), True

    @staticmethod
    async def _reply(
        link: _Link, key: bytes, fut: asyncio.Future, deadline: float, url: str, timeout_s: float
    ) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(fut, max(deadline - loop.time(), 0.001))
        except TimeoutError:
            raise _error("hop_timeout", f"next hop {url} did not answer within {timeout_s:g} s", url) from None
        finally:
            if link.pending.get(key) is fut:
                del link.pending[key]

    async def _post(self, url: str, frame: bytes, timeout_s: float) -> tuple[int, bytes]:
        try:
            async with self._client().post(
                url + "/v1/step",
                data=frame,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                headers={"Content-Type": "application/octet-stream"},
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise _error("hop_timeout", f"next hop {url} did not answer within {timeout_s:g} s", url) from None
        except aiohttp.ClientError as exc:
            raise _error("hop_failed", f"next hop {url} failed: {type(exc).__name__}: {exc}", url) from None

    def counts(self) -> dict:
        """``{"out": links open, "http_only": next hops reached by POST /v1/step}`` (for /health)."""
        return {"out": sum(1 for link in self._links.values() if not link.ws.closed), "http_only": len(self._http_only)}

    async def close(self) -> None:
        """Close every link (their waiters get hop_failed)."""
        for link in list(self._links.values()):
            await link.ws.close()
            if link.reader is not None:
                await link.reader
        self._links.clear()


def reply_error(body: bytes, status: int, url: str) -> ProtocolError:
    """The ProtocolError for a next hop's error reply (``status`` >= 400, JSON ``{"error": ...}``)."""
    try:
        err = json.loads(body)["error"]
        code, message, hop = str(err["code"]), str(err["message"])[:MAX_HOP_MESSAGE_CHARS], err.get("hop")
        if code not in ERROR_STATUS or (hop is not None and not isinstance(hop, str)):
            raise ValueError("not a protocol error")
    except (ValueError, KeyError, TypeError, AttributeError):
        # not a node's protocol error: its body is never passed on (the next hop may not be a node at all)
        code, hop = "hop_failed", None
        message = f"answered {status} with {len(body)} bytes that are not a protocol error"
    # the failed node: the one a deeper hop named, else the next hop itself
    return ProtocolError(code, f"next hop {url}: {message}", status, hop or url)


__all__ = ["HopLinks", "reply_error"]
