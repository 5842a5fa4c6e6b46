"""Relaying TCP over one websocket, so that a node behind NAT can be reached (like a TURN or frp tunnel).

A reachable process runs a relay server (``add_relay_routes``); an unreachable node runs a ``RelayClient``
(net/relay_client.py) that keeps one outbound websocket to it. The relay listens on a port of its own host for each
attached node and carries every TCP connection to that port as a stream over the websocket (OPEN, DATA, CLOSE,
WINDOW messages, flow-controlled per stream), so HTTP requests and links reach the node unchanged. The wire format
and limits: docs/protocol.md, "Relays"."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from ..protocol.errors import ProtocolError
from .http import error_response

log = logging.getLogger(__name__)

HEADER = struct.Struct("!IB")  # stream id, op
U32 = struct.Struct("!I")
OPEN, DATA, CLOSE, WINDOW = 1, 2, 3, 4
OPS = frozenset({OPEN, DATA, CLOSE, WINDOW})
CHUNK = 64 * 1024  # most bytes per DATA message
WINDOW_BYTES = 1024 * 1024  # most unacknowledged DATA bytes per stream and direction
ACK_EVERY = WINDOW_BYTES // 4  # the receiver acknowledges once it has written this many bytes
MAX_MSG = CHUNK + HEADER.size + 64
ATTACH_PATH = "/v1/relay/attach"
MAX_CLIENTS = 64  # clients attached to one relay at once (more: 503 relay_full)
MAX_CLIENTS_PER_ADDRESS = 8  # of them, attached from one address (a home's nodes share its NAT's address)
MAX_REMOTE = 64  # most bytes of an OPEN's payload (the inbound connection's address)
MAX_STREAMS = 256  # open connections per attached client (more are closed at once)
HEARTBEAT_S = 15.0  # websocket ping interval; a peer silent for half of it more is dropped
ATTACH_TIMEOUT_S = 10.0
STABLE_S = 30.0  # an attachment that lasted this long resets the re-attach backoff


class RelayError(RuntimeError):
    """A relay could not be attached to: unreachable, refused (token, full, no relay there) or a bad answer."""


class _Violation(Exception):
    """A malformed message from the peer: the attachment is closed."""


class _Counters:
    """DATA payload bytes: ``tx`` sent over the websocket, ``rx`` received; counted into ``parent`` too, and into
    ``prom`` (Prometheus counter children for tx, rx)."""

    def __init__(self, parent: _Counters | None = None, prom: tuple | None = None):
        self.tx = self.rx = 0
        self.parent, self.prom = parent, prom

    def count(self, n: int, sent: bool) -> None:
        if sent:
            self.tx += n
        else:
            self.rx += n
        if self.prom is not None:
            self.prom[0 if sent else 1].inc(n)
        if self.parent is not None:
            self.parent.count(n, sent)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Stream:
    """One TCP connection carried over the websocket."""

    __slots__ = (
        "sid",
        "remote",
        "reader",
        "writer",
        "inbox",
        "credit",
        "credit_ready",
        "owed",
        "unacked",
        "closed_sent",
        "idle",
        "local_port",
    )

    def __init__(self, sid: int, remote: str = ""):
        self.sid = sid
        self.remote = remote  # the address the inbound connection came from ("" unknown)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()  # bounded by the window
        self.credit = WINDOW_BYTES  # bytes we may still send
        self.credit_ready = asyncio.Event()
        self.owed = 0  # bytes received and not yet acknowledged (the peer's window in use)
        self.unacked = 0  # of those, bytes already written to our socket
        self.closed_sent = False  # CLOSE sent or received: say nothing more about this stream
        self.idle = False  # the stream's task waits for the inbox, all it took written
        self.local_port = 0  # the client end: the source port of its connection to the local server


class _Mux:
    """The streams of one websocket, at either end. ``serve()`` reads the websocket until it closes."""

    def __init__(self, ws, counters: _Counters, name: str, accept_open: bool):
        self.ws, self.counters, self.name = ws, counters, name
        self.accept_open = accept_open  # the client end takes OPEN; the relay end never does
        self.connect: Callable[[_Stream], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] | None = None
        self.streams: dict[int, _Stream] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.background: set[asyncio.Task] = set()
        self.closed = False
        self.on_closed: Callable[[_Stream], object] | None = None  # called as each stream ends

    async def send(self, sid: int, op: int, payload: bytes = b"") -> None:
        await self.ws.send_bytes(HEADER.pack(sid, op) + payload)

    async def serve(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    if msg.type == aiohttp.WSMsgType.ERROR:
                        log.info("relay %s: websocket error: %s", self.name, self.ws.exception())
                        break
                    raise _Violation(f"unexpected {msg.type.name} message")
                self._dispatch(msg.data)
        except _Violation as exc:
            log.warning("relay %s: closing the attachment: %s", self.name, exc)
            self.shutdown()
            await self.ws.close(code=aiohttp.WSCloseCode.PROTOCOL_ERROR, message=str(exc)[:100].encode())
        finally:
            self.shutdown()

    def _dispatch(self, data: bytes) -> None:
        if len(data) < HEADER.size:
            raise _Violation(f"message of {len(data)} bytes is shorter than its header")
        sid, op = HEADER.unpack_from(data)
        if op not in OPS:
            raise _Violation(f"unknown op {op} (stream {sid})")
        st = self.streams.get(sid)
        if op == OPEN:
            if not self.accept_open or st is not None or len(data) > HEADER.size + MAX_REMOTE:
                raise _Violation(f"OPEN of stream {sid} not allowed here")
            if len(self.streams) >= MAX_STREAMS:
                refuse = asyncio.create_task(self.send(sid, CLOSE))
                self.background.add(refuse)
                refuse.add_done_callback(self.background.discard)
                return
            st = self.streams[sid] = _Stream(sid, data[HEADER.size :].decode("utf-8", "replace"))
            self.tasks[sid] = asyncio.create_task(self.run_stream(st))
        elif st is None or st.closed_sent:
            return  # a stream already closed here: its peer had not heard yet
        elif op == DATA:
            payload = data[HEADER.size :]
            st.owed += len(payload)
            if st.owed > WINDOW_BYTES:
                raise _Violation(f"stream {sid}: DATA past the window ({st.owed} bytes unacknowledged)")
            self.counters.count(len(payload), sent=False)
            if st.idle and st.inbox.empty() and not st.writer.transport.get_write_buffer_size():
                st.writer.write(payload)  # the fast path: the socket keeps up, no task switch
                st.unacked += len(payload)
                if st.unacked >= ACK_EVERY:
                    st.inbox.put_nowait(b"")  # wakes the stream's task to acknowledge
            else:
                st.inbox.put_nowait(payload)
        elif op == WINDOW:
            if len(data) != HEADER.size + U32.size:
                raise _Violation(f"stream {sid}: WINDOW of {len(data) - HEADER.size} payload bytes")
            st.credit += U32.unpack_from(data, HEADER.size)[0]
            st.credit_ready.set()
        else:  # CLOSE
            st.closed_sent = True
            st.inbox.put_nowait(None)

    async def run_stream(self, st: _Stream, reader=None, writer=None) -> None:
        """Carry one stream until either side closes it: the relay end passes its accepted connection (and
        sends OPEN first); the client end connects to its local port."""
        self.streams[st.sid] = st
        self.tasks.setdefault(st.sid, asyncio.current_task())
        pump = None
        try:
            if reader is None:
                reader, writer = await self.connect(st)
                _nodelay(writer)
            else:
                await self.send(st.sid, OPEN, st.remote.encode()[:MAX_REMOTE])
            st.reader, st.writer = reader, writer
            pump = asyncio.create_task(self._pump_out(st))
            while True:
                st.idle = st.inbox.empty()
                data = await st.inbox.get()
                st.idle = False
                if data is None:
                    break
                writer.write(data)
                await writer.drain()
                st.unacked += len(data)
                if st.unacked >= ACK_EVERY and not st.closed_sent:
                    n, st.unacked = st.unacked, 0
                    st.owed -= n
                    await self.send(st.sid, WINDOW, U32.pack(n))
        except (OSError, ConnectionError, aiohttp.ClientError) as exc:
            log.debug("relay %s: stream %d: %s", self.name, st.sid, exc)
        finally:
            if pump is not None:
                pump.cancel()
            await self._close_once(st)
            if writer is not None:
                writer.close()
            self.streams.pop(st.sid, None)
            self.tasks.pop(st.sid, None)
            if self.on_closed is not None:
                self.on_closed(st)

    async def _pump_out(self, st: _Stream) -> None:
        """Local socket → DATA messages, as the peer's window allows; at EOF: CLOSE, and end the stream."""
        try:
            while True:
                while st.credit <= 0:
                    st.credit_ready.clear()
                    await st.credit_ready.wait()
                data = await st.reader.read(min(CHUNK, st.credit))
                if not data or st.closed_sent:
                    break
                st.credit -= len(data)
                self.counters.count(len(data), sent=True)
                await self.send(st.sid, DATA, data)
        except (OSError, ConnectionError, aiohttp.ClientError) as exc:
            log.debug("relay %s: stream %d read: %s", self.name, st.sid, exc)
        await self._close_once(st)
        st.inbox.put_nowait(None)

    async def _close_once(self, st: _Stream) -> None:
        if not st.closed_sent and not self.closed:
            st.closed_sent = True
            try:
                await self.send(st.sid, CLOSE)
            except (OSError, ConnectionError, aiohttp.ClientError):
                pass

    def shutdown(self) -> None:
        """Drop every stream (the websocket is gone)."""
        self.closed = True
        for task in list(self.tasks.values()):
            task.cancel()
        for st in list(self.streams.values()):
            if st.writer is not None:
                st.writer.close()
        self.streams.clear()


class _Attached:
    """One attached relay client, as the relay server sees it."""

    def __init__(self, remote: str | None):
        self.remote = remote
        self.port: int | None = None
        self.mux: _Mux | None = None
        self.listener: asyncio.AbstractServer | None = None
        self.since = time.monotonic()


class RelayServer:
    """The relay end: one public TCP port per attached client (``add_relay_routes`` makes it)."""

    def __init__(self, public_host: str, bind_host: str = "0.0.0.0", max_clients: int = MAX_CLIENTS, registry=None):
        self.public_host, self.bind_host, self.max_clients = public_host, bind_host, max_clients
        self.clients: dict[int, _Attached] = {}
        self._ids = 0
        self.hooks: list[Callable[[str, web.Request, int], None]] = []  # (attached|detached, request, port)
        prom = None
        if registry is not None:
            from prometheus_client import Counter

            help_ = "Bytes relayed (in: from public connections to attached clients; out: back)"
            prom = Counter("ggufswarm_relay_bytes", help_, ["direction"], registry=registry)
        self.totals = _Counters(prom=(prom.labels("in"), prom.labels("out")) if prom else None)

    def stats(self) -> dict:
        """Per attached client: ``remote`` (its IP), ``port``, ``streams`` open, ``bytes_in`` (bytes from public
        connections carried to it), ``bytes_out`` (bytes it sent back), ``attached_s``; and the totals."""
        now = time.monotonic()
        clients = [
            {
                "remote": c.remote,
                "port": c.port,
                "streams": len(c.mux.streams),
                "bytes_in": c.mux.counters.tx,
                "bytes_out": c.mux.counters.rx,
                "attached_s": round(now - c.since, 3),
            }
            for c in self.clients.values()
            if c.mux is not None and c.port is not None
        ]
        return {
            "clients": clients,
            "streams": sum(c["streams"] for c in clients),
            "bytes_in": self.totals.tx,
            "bytes_out": self.totals.rx,
        }

    async def attach(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/relay/attach``: the websocket of one relay client (503 ``relay_full`` over max_clients)."""
        if len(self.clients) >= self.max_clients:
            msg = f"this relay serves {self.max_clients} clients already: try another relay"
            return error_response(ProtocolError("relay_full", msg, status=503))
        if sum(c.remote == request.remote for c in self.clients.values()) >= MAX_CLIENTS_PER_ADDRESS:
            msg = f"this relay serves {MAX_CLIENTS_PER_ADDRESS} nodes from {request.remote} already"
            return error_response(ProtocolError("relay_full", msg, status=503))
        self._ids += 1
        key = self._ids
        client = self.clients[key] = _Attached(request.remote)
        listener = None
        try:
            ws = web.WebSocketResponse(compress=False, max_msg_size=MAX_MSG, heartbeat=HEARTBEAT_S, autoping=True)
            await ws.prepare(request)
            counters = _Counters(parent=self.totals)
            mux = _Mux(ws, counters, f"{request.remote} ", accept_open=False)
            try:
                listener = await asyncio.start_server(lambda r, w: self._accept(mux, r, w), self.bind_host, 0)
            except OSError as exc:
                log.warning("relay: cannot listen on %s for %s: %s", self.bind_host, request.remote, exc)
                await ws.close(code=aiohttp.WSCloseCode.TRY_AGAIN_LATER, message=b"relay cannot listen")
                return ws
            client.listener, client.port = listener, listener.sockets[0].getsockname()[1]
            mux.name = f"{request.remote} (port {client.port})"
            client.mux = mux
            await ws.send_str(json.dumps({"host": self.public_host, "port": client.port}))
            log.info("relay: %s attached at %s:%d", request.remote, self.public_host, client.port)
            for hook in self.hooks:  # e.g. announce the relayed node on the DHT (node/app.py)
                hook("attached", request, client.port)
            await mux.serve()
            log.info("relay: %s (port %d) detached", request.remote, client.port)
            return ws
        finally:
            for hook in self.hooks if client.port else ():
                hook("detached", request, client.port)
            if listener is not None:
                listener.close()
            if client.mux is not None:
                client.mux.shutdown()
            self.clients.pop(key, None)

    async def _accept(self, mux: _Mux, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if mux.closed or len(mux.streams) >= MAX_STREAMS:
            writer.close()
            return
        _nodelay(writer)
        self._ids += 1
        sid = self._ids & 0xFFFFFFFF
        peer = writer.get_extra_info("peername")
        try:
            await mux.run_stream(_Stream(sid, str(peer[0]) if peer else ""), reader, writer)
        except asyncio.CancelledError:  # the top of its task: Python 3.11's start_server logs one not swallowed
            pass

    async def close(self) -> None:
        """Close every attachment, its port and its streams."""
        for client in list(self.clients.values()):
            if client.listener is not None:
                client.listener.close()
            if client.mux is not None:
                client.mux.shutdown()
                await client.mux.ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"relay shutting down")


RELAY = web.AppKey("relay", RelayServer)  # the RelayServer of an app made a relay by add_relay_routes


def add_relay_routes(app: web.Application, public_host: str, bind_host: str = "0.0.0.0", registry=None) -> RelayServer:
    """Make ``app`` a relay: ``GET /v1/relay/attach`` (behind the app's token middleware) and closing every
    attachment when the app shuts down. ``public_host``: the host name or IP clients are told to advertise;
    ``bind_host``: where the per-client ports listen; ``registry``: a Prometheus registry to count
    ``ggufswarm_relay_bytes_total{direction="in"|"out"}`` in (bytes). Returns the RelayServer (``stats()``)."""
    relay = RelayServer(public_host, bind_host, registry=registry)
    app.router.add_get(ATTACH_PATH, relay.attach)

    app.on_shutdown.append(lambda _app: relay.close())
    return relay
