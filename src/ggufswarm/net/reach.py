"""Dial-back reachability checks: can the rest of the swarm open a connection to this node's port?

A node asks a reachable helper (a tracker, a relay, another node) ``POST /v1/reach/dialback {"port": P}``; the
helper dials ``http://OBSERVED_IP:P/v1/reach/probe`` (or ``/health``) back, where OBSERVED_IP is the address the
request came from, and says whether it got an HTTP answer. The helper only ever dials the requester's own
address, only those two paths, and at most RATE_PER_MIN times a minute per requester: it is no open proxy
nor port scanner.

``GET /v1/reach/probe`` answers ``{"ok": true}`` WITHOUT the swarm token (the helper does not send it): the
token middleware must let exactly PUBLIC_PATHS through (``skip_public_paths`` wraps one so).
"""

from __future__ import annotations

import collections
import ipaddress
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from ..protocol.errors import ProtocolError
from .auth import auth_headers
from .http import error_response, read_json
from .identity import IdentityError, canonical, verify

PROBE_PATH = "/v1/reach/probe"
DIALBACK_PATH = "/v1/reach/dialback"
PUBLIC_PATHS = frozenset({PROBE_PATH})  # paths the token middleware must serve without the swarm token
DIAL_PATHS = ("/health", PROBE_PATH)  # the only paths a helper dials back
DIAL_TIMEOUT_S = 2.0
RATE_PER_MIN = 10  # dial-backs per requester IP per minute (more: 429)
MAX_TRACKED_IPS = 10000  # requester IPs whose recent dial-backs are remembered (the oldest are forgotten)
CHECK_TIMEOUT_S = 10.0  # check_reachable: the whole exchange with the helper
PROVEN_S = 300.0  # an address that proved to hold a node's key is trusted with the token this long (Proven)


class ReachError(RuntimeError):
    """The helper could not be asked: unreachable, or it refused (``status``: its HTTP status, None if none)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Reachability:
    """A dial-back's result: ``reachable`` (the helper got an HTTP answer from ``observed_ip``:port),
    ``observed_ip`` (this node's address as the helper sees it), ``ms`` (the helper's dial time, ms),
    ``status`` (the HTTP status it got, None if none), ``error`` (why it got none, else None)."""

    reachable: bool
    observed_ip: str | None
    ms: float
    error: str | None = None
    status: int | None = None


def skip_public_paths(middleware, paths: frozenset[str] = PUBLIC_PATHS):
    """``middleware`` (e.g. ``net.auth.token_middleware(token)``) for every path except ``paths``, which
    are served without it."""

    @web.middleware
    async def skip(request: web.Request, handler):
        if request.path in paths:
            return await handler(request)
        return await middleware(request, handler)

    return skip


MAX_CHALLENGE_CHARS = 128


def probe_statement(challenge: str) -> bytes:
    """What a node signs to answer ``GET /v1/reach/probe?challenge=C``: it holds its key at the address dialled."""
    return canonical({"op": "probe", "challenge": challenge})


def add_probe_route(app: web.Application, identity=None) -> None:
    """Serve ``GET /v1/reach/probe`` on ``app`` (every node: it is what helpers dial back), without the swarm token:
    ``{"ok": true}``; with ``?challenge=C`` (at most MAX_CHALLENGE_CHARS) and a node ``identity``
    (net.identity.NodeIdentity), also ``"key"`` and ``"sig"``: its signature of ``probe_statement(C)``, so that a
    tracker checking a node learns that the node, not whatever else listens there, answered."""

    async def probe(request: web.Request) -> web.Response:
        challenge = request.query.get("challenge")
        if identity is None or not challenge or len(challenge) > MAX_CHALLENGE_CHARS:
            return web.json_response({"ok": True})
        return web.json_response({"ok": True, "key": identity.key_id, "sig": identity.sign(probe_statement(challenge))})

    app.router.add_get(PROBE_PATH, probe)


async def prove(url: str, timeout_s: float) -> tuple[str | None, str | None]:
    """The key of the node at ``url``: ``GET url/v1/reach/probe?challenge=RANDOM`` in a session of its own (no
    swarm token, no cookies), without following redirects, and its signature checked. ``(key, None)``, or ``(None,
    why not)``: no answer, not a node (nothing signed), a bad signature."""
    challenge = secrets.token_hex(16)
    try:
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
            http.get(
                f"{url.rstrip('/')}{PROBE_PATH}",
                params={"challenge": challenge},
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp,
        ):
            body = await resp.json(content_type=None) if resp.status == 200 else None
    except TimeoutError:
        return None, f"no answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(body, dict) or not isinstance(body.get("key"), str):
        return None, "what answers there signs nothing: not a node"
    try:
        verify(body["key"], probe_statement(challenge), body.get("sig"))
    except (IdentityError, TypeError) as exc:
        return None, f"its answer to the challenge does not verify ({exc})"
    return body["key"], None


async def answers_as(url: str, keys: set[str], timeout_s: float) -> str | None:
    """Whether the node at ``url`` holds one of ``keys`` (``prove``): None when it does; else why not."""
    key, why = await prove(url, timeout_s)
    if key is None:
        return why
    return None if key in keys else "what answers there is not the node advertised at that address"


class Proven:
    """Node addresses that proved lately (``prove``, within ``ttl_s`` s) to hold a key: where a node sends the swarm
    token. Remembers at most ``max_entries`` addresses."""

    def __init__(self, ttl_s: float = PROVEN_S, max_entries: int = MAX_TRACKED_IPS):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._keys: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    async def key_of(self, url: str, timeout_s: float = DIAL_TIMEOUT_S) -> tuple[str | None, str | None]:
        """``(key, None)``: the key the node at ``url`` proved to hold (now, or within ``ttl_s``); ``(None, why)``."""
        url, now = url.rstrip("/"), time.monotonic()
        known = self._keys.get(url)
        if known is not None and known[1] > now:
            return known[0], None
        key, why = await prove(url, timeout_s)
        if key is not None:
            self._keys[url] = (key, now + self.ttl_s)
            self._keys.move_to_end(url)
            while len(self._keys) > self.max_entries:
                self._keys.popitem(last=False)
        return key, why

    async def check(self, url: str, key: str, timeout_s: float = DIAL_TIMEOUT_S) -> str | None:
        """None when the node at ``url`` holds ``key`` (proved now or lately); else why not."""
        got, why = await self.key_of(url, timeout_s)
        if got is None:
            return why
        return None if got == key else "what answers there is not the node advertised at that address"


class RateLimit:
    """At most ``per_min`` events per key in any 60 s."""

    def __init__(self, per_min: int):
        self.per_min = per_min
        self.seen: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        times = self.seen.pop(key, None) or collections.deque()
        while times and now - times[0] >= 60.0:
            times.popleft()
        self.seen[key] = times  # most recent last
        while len(self.seen) > MAX_TRACKED_IPS:
            self.seen.popitem(last=False)
        if len(times) >= self.per_min:
            return False
        times.append(now)
        return True


def _url_host(ip: str) -> str:
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


async def dial(url: str, timeout_s: float) -> tuple[int | None, str | None, float]:
    """``GET url`` without the swarm token, without following redirects: ``(HTTP status, None, ms)`` when it
    answered, ``(None, why, ms)`` when not (``connection refused``, ``timeout``, ...). Never raises for a
    network error."""
    began = time.perf_counter()
    status, why = None, None
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as http:
            async with http.get(url, allow_redirects=False) as resp:
                status = resp.status
    except TimeoutError:
        why = f"timeout ({timeout_s:g} s)"
    except aiohttp.ClientConnectorError as exc:
        err = exc.os_error
        why = "connection refused" if isinstance(err, ConnectionRefusedError) else f"cannot connect: {err or exc}"
    except (aiohttp.ClientError, OSError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    ms = (time.perf_counter() - began) * 1000.0
    return status, (" ".join(why.splitlines()) if why else None), ms


def add_dialback_route(
    app: web.Application,
    timeout_s: float = DIAL_TIMEOUT_S,
    rate_per_min: int = RATE_PER_MIN,
    requester: Callable[[web.Request], str | None] | None = None,
) -> None:
    """Serve ``POST /v1/reach/dialback`` on ``app`` (behind its token middleware). Body ``{"port": int,
    "path": "/v1/reach/probe" (default) or "/health", "host": optional, only the requester's own IP}``; dials
    ``http://REQUESTER_IP:port/path`` within ``timeout_s`` s and answers ``{"observed_ip", "reachable",
    "status", "error", "ms"}``. ``requester(request)``: the requester's real address (a relayed node's: the one its
    relay saw, not the relay's local connection; None: unknown, refused), by default ``request.remote``. Errors:
    400 ``bad_request`` (port outside 1..65535, another path, another host, an unknown requester), 429
    ``rate_limited`` past ``rate_per_min`` dial-backs a minute from one address."""
    limit = RateLimit(rate_per_min)
    requester = requester or (lambda request: request.remote)

    async def dialback(request: web.Request) -> web.Response:
        try:
            return await answer(request)
        except ProtocolError as err:  # answered here too in an app without json_errors_middleware
            return error_response(err)

    async def answer(request: web.Request) -> web.Response:
        body = await read_json(request)
        observed = requester(request)
        port, path, host = body.get("port"), body.get("path", PROBE_PATH), body.get("host")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ProtocolError("bad_request", f"port must be an integer in 1..65535, got {port!r}")
        if path not in DIAL_PATHS:
            raise ProtocolError("bad_request", f"path must be one of {', '.join(DIAL_PATHS)}, got {path!r}")
        if host is not None and host != observed:
            raise ProtocolError("bad_request", f"a dial-back goes to the requester's own address {observed} only")
        if not observed:
            raise ProtocolError("bad_request", "the requester's address is unknown")
        if not limit.allow(observed):
            msg = f"at most {rate_per_min} dial-backs a minute from one address: retry later"
            return error_response(ProtocolError("rate_limited", msg, status=429), headers={"Retry-After": "60"})
        status, why, ms = await dial(f"http://{_url_host(observed)}:{port}{path}", timeout_s)
        result = {"observed_ip": observed, "reachable": status is not None, "status": status, "error": why}
        return web.json_response({**result, "ms": round(ms, 3)})

    app.router.add_post(DIALBACK_PATH, dialback)


async def check_reachable(
    session: aiohttp.ClientSession,
    helper_url: str,
    port: int,
    token: str | None,
    path: str = PROBE_PATH,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> Reachability:
    """Ask the helper at ``helper_url`` (``http://HOST:PORT``) to dial ``port`` of this machine back (``path``:
    ``/v1/reach/probe``, which the node serves without the token, or ``/health``), within ``timeout_s`` s.
    Raises ReachError when the helper cannot be reached, does not answer in time, or refuses (401 token, 400,
    404 no dial-back there, 429 rate limit; ``.status``)."""
    url = helper_url.rstrip("/") + DIALBACK_PATH
    try:
        async with session.post(
            url,
            json={"port": port, "path": path},
            headers=auth_headers(token),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            text = await resp.text()
            if resp.status != 200:
                why = f"helper {helper_url} refused the dial-back: HTTP {resp.status} {text[:200]}"
                raise ReachError(why, resp.status)
            try:
                body = await resp.json(content_type=None)
            except ValueError as exc:
                raise ReachError(f"helper {helper_url} gave a bad answer: {exc}", resp.status) from None
    except TimeoutError:
        raise ReachError(f"helper {helper_url} did not answer within {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise ReachError(f"cannot reach helper {helper_url}: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("reachable"), bool):
        raise ReachError(f"helper {helper_url} gave a bad answer: {str(body)[:200]}", 200)
    return Reachability(
        reachable=body["reachable"],
        observed_ip=body.get("observed_ip"),
        ms=float(body.get("ms") or 0.0),
        error=body.get("error"),
        status=body.get("status"),
    )
