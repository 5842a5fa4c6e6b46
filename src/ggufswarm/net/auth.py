"""The swarm token: internal endpoints (nodes, tracker, cache) answer only requests that carry it.

Every server and client takes the token explicitly (its config, or a ``token=`` argument); only the command
line reads ``$GGUFSWARM_TOKEN`` (``--token`` overrides it)."""

from __future__ import annotations

import hmac
import json

from aiohttp import web

TOKEN_ENV = "GGUFSWARM_TOKEN"  # read by the command line only (cli.py): the library takes the token as an argument
TOKEN_HEADER = "X-Ggufswarm-Token"
# the tracker operator's credential, apart from the swarm token: lifting bans, removing another node (tracker/bans.py)
OPERATOR_ENV = "GGUFSWARM_OPERATOR_TOKEN"
OPERATOR_HEADER = "X-Ggufswarm-Operator"


def auth_headers(token: str | None) -> dict[str, str]:
    """Headers that authenticate an internal request with ``token`` (empty for None: an open swarm)."""
    return {TOKEN_HEADER: token} if token else {}


def announce_key(token: str) -> str:
    """The key BitTorrent clients announce with (``/announce?swarm_key=…``, written into every .torrent): an HMAC of
    the swarm token, so the token itself is never in a torrent, a manifest or the tracker's database. It lets
    its holder announce and nothing else."""
    return hmac.new(token.encode(), b"ggufswarm-announce/1", "sha256").hexdigest()[:40]


def token_middleware(token: str | None):
    """aiohttp middleware: without a matching ``X-Ggufswarm-Token`` header (or ``token`` query parameter,
    for peers that cannot set headers, such as BitTorrent clients announcing) → 401 JSON error."""

    @web.middleware
    async def check(request: web.Request, handler):
        if token:
            given = request.headers.get(TOKEN_HEADER) or request.query.get("token") or ""
            key = request.query.get("swarm_key") if request.path == "/announce" else None
            if key is not None and hmac.compare_digest(key.encode(), announce_key(token).encode()):
                return await handler(request)
            if not hmac.compare_digest(given.encode(), token.encode()):
                body = {
                    "error": {
                        "code": "unauthorized",
                        "message": "missing or wrong swarm token "
                        f"({TOKEN_HEADER} header or ?token=; ggufswarm "
                        f"commands take it as --token or ${TOKEN_ENV})",
                    }
                }
                return web.Response(status=401, text=json.dumps(body), content_type="application/json")
        return await handler(request)

    return check
