"""JSON calls to route nodes over aiohttp (a session's frame links: net/link.py).

Every call here is a coroutine on the caller's event loop; failures are RouteErrors that name the node
(``hop_timeout`` when it did not answer in time, ``hop_failed`` when its connection failed, else the node's
own error code and status).
"""

from __future__ import annotations

import json

import aiohttp

from ..net.link import request
from ..protocol.errors import RouteError

JSON = "application/json"
ERROR_TEXT_CHARS = 200  # how much of a non-JSON error body a RouteError quotes


# Errors that mean a node of the route is gone or lost the session: a repair can replace it.
# node_banned: the gateway's verifier caught a node of the route lying (gateway/verify.py); the route is repaired
# around it with every node's KV rolled back to 0 (what came after it was computed from its outputs);
# session_closed: closed on the node by a DELETE this client did not send (its own closing never reads the answer)
REPAIRABLE = frozenset({"hop_failed", "hop_timeout", "internal", "unknown_session", "session_closed", "node_banned"})
BANNED = "node_banned"


def new_http_session() -> aiohttp.ClientSession:
    """An aiohttp session for route traffic on the running loop: no cap on connections (each route session
    holds one or two WebSockets), Nagle off (aiohttp's default), no cookies. Close it when done."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar())


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


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of a node's error reply ``body``, or None."""
    err = _error(body).get("code")
    return err if isinstance(err, str) else None


def error_hop(body: bytes) -> str | None:
    """The node a node's error reply ``body`` names (``error.hop``), or None."""
    hop = _error(body).get("hop")
    return hop if isinstance(hop, str) else None


def _error(body: bytes) -> dict:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return err if isinstance(err, dict) else {}


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
        raise RouteError(code, text, status if status >= 400 else 502, hop)
    return data
