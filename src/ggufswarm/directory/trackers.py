"""The tracker client: every call any part of ggufswarm makes to the tracker's HTTP API (docs/protocol.md,
"Tracker"), the URLs they use, ``TrackerError``, and ``wait_for_model``.

Blocking calls (``urllib``) serve the command line, publishing, fetching and route planning; the node's own
calls (heartbeats, next-hop checks, deregistering) run on its event loop through an ``aiohttp`` session it owns
(the ``a``-prefixed methods).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import quote, urlencode

import aiohttp

from ..net.auth import OPERATOR_HEADER, auth_headers
from ..net.identity import deregistration

DEFAULT_TIMEOUT_S = 30.0


class TrackerError(RuntimeError):
    """The tracker refused a request or could not be reached (the message says which). ``status``: its HTTP
    status, or None when it could not be reached; ``reason``: the tracker's own words, without its URL."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason or message


class TrackerClient:
    """Calls to the tracker at ``url`` (``http://HOST:PORT``) with the swarm ``token`` (None: none sent).

    Every method raises TrackerError with the tracker's reason on a 4xx/5xx answer or when the tracker cannot be
    reached (the async ones: within their ``timeout_s``)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def url_for(self, path: str, query: dict | None = None) -> str:
        """The absolute URL of tracker endpoint ``path`` (``"models"``, ``"nodes/report"``...) with ``query``."""
        return f"{self.url}/{path.lstrip('/')}" + (f"?{urlencode(query)}" if query else "")

    # -- blocking calls ------------------------------------------------------------------------------
    def call(
        self,
        path: str,
        method: str = "GET",
        body: dict | None = None,
        *,
        query: dict | None = None,
        timeout_s: float | None = None,
        headers: dict | None = None,
    ) -> dict:
        """One JSON request to endpoint ``path`` (``headers``: more than the token's); the decoded JSON answer.
        TrackerError on a refusal."""
        url = self.url_for(path, query)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", **auth_headers(self.token), **(headers or {})}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s if timeout_s is None else timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                reason = e.reason
            raise TrackerError(f"tracker {url}: {e.code} {reason}", e.code, str(reason)) from None
        except (urllib.error.URLError, OSError) as e:
            raise TrackerError(
                f"cannot reach tracker {url}: {getattr(e, 'reason', e)}", None, "the tracker cannot be reached"
            ) from None

    def models(self, timeout_s: float | None = None) -> list[str]:
        """Names of the published models (``GET /models``)."""
        return self.call("models", timeout_s=timeout_s)["models"]

    def manifest(self, name: str, timeout_s: float | None = None) -> dict:
        """Model ``name``'s manifest and torrent (``GET /manifests/{name}``: ``{"manifest", "torrent_hex"}``)."""
        return self.call(f"manifests/{quote(name, safe='')}", timeout_s=timeout_s)

    def put_manifest(self, name: str, manifest: dict, torrent: bytes) -> dict:
        """Publish model ``name``: its manifest (JSON object) and torrent (``PUT /manifests/{name}``)."""
        return self.call(
            f"manifests/{quote(name, safe='')}", "PUT", {"manifest": manifest, "torrent_hex": torrent.hex()}
        )

    def nodes(self, model: str | None = None) -> list[dict]:
        """The advertisements of live nodes (of ``model``; None: all) (``GET /nodes``)."""
        return self.call("nodes", query={"model": model} if model is not None else None).get("nodes", [])

    def peers(self, model: str, timeout_s: float | None = None) -> list[dict]:
        """The BitTorrent peers of ``model``'s torrent as they announced themselves (``GET /peers``):
        ``[{"ip", "port", "left"}]``, seeds (``left`` 0) first."""
        return self.call("peers", query={"model": model}, timeout_s=timeout_s)["peers"]

    def route(self, query: dict, timeout_s: float | None = None) -> dict:
        """A planned route (``GET /route``; ``query``: model, max_length, exclude, start, end...)."""
        return self.call("route", query=query, timeout_s=timeout_s)

    def report(self, node_url: str, timeout_s: float | None = None) -> dict:
        """Report node ``node_url`` as failing (``POST /nodes/report``): the tracker checks it and drops it."""
        return self.call("nodes/report", "POST", {"url": node_url}, timeout_s=timeout_s)

    def ban(self, key: str, reason: str, evidence: dict | None = None) -> dict:
        """Ban node key ``key`` (64 hex characters) from the swarm (``POST /v1/bans``) with a one-line ``reason``
        and ``evidence`` (a JSON object: what the node signed that proves it lied). The tracker drops its
        advertisements at once and refuses its heartbeats from then on; ``{"banned": key}``."""
        return self.call("v1/bans", "POST", {"key": key, "reason": reason, "evidence": evidence or {}})

    def lift(self, key: str, operator_token: str) -> dict:
        """Lift the ban of node key ``key`` (``DELETE /v1/bans/{key}``): the operator only (``operator_token``: the
        tracker's ``--operator-token``); ``{"lifted": key}``."""
        return self.call(f"v1/bans/{quote(key, safe='')}", "DELETE", headers={OPERATOR_HEADER: operator_token})

    def bans(self, timeout_s: float | None = None) -> list[dict]:
        """The swarm's bans (``GET /v1/bans``): ``[{"key", "reason", "at" (unix s)}]``, oldest first."""
        return self.call("v1/bans", timeout_s=timeout_s)["bans"]

    def status(self) -> dict:
        """The tracker's whole view (``GET /status.json``): nodes, models, coverage."""
        return self.call("status.json")

    def wait_for_model(
        self, name: str | None, every_s: float = 2.0, parent: int | None = None, who: str = "node"
    ) -> None:
        """Block until the tracker answers and has ``name`` published (None: until it answers), saying once (one
        line, as ``ggufswarm {who}``) what it waits for: start order does not matter. Raises TrackerError for any
        other refusal (a wrong token, say), SystemExit when ``parent`` (a pid) is gone (``--exit-with-parent``)."""
        said = None
        while True:
            if parent is not None and os.getppid() != parent:
                raise SystemExit(1)
            try:
                self.manifest(name, timeout_s=10) if name else self.models(timeout_s=10)
                if said:
                    print(
                        f"ggufswarm {who}: {'the tracker answers' if name is None else name + ' is published'}; "
                        f"going on",
                        file=sys.stderr,
                        flush=True,
                    )
                return
            except TrackerError as exc:
                if exc.status not in (None, 404):
                    raise
                why = (
                    f"waiting for the tracker {self.url} to answer"
                    if exc.status is None
                    else f"waiting for model {name!r} to be published on {self.url} (ggufswarm publish --name {name})"
                )
                if why != said:
                    print(
                        f"ggufswarm {who}: {why}; retrying every {every_s:g} s (Ctrl-C stops)",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = why
            time.sleep(every_s)

    # -- a node's calls, on its event loop ------------------------------------------------------------
    async def acall(
        self,
        http: aiohttp.ClientSession,
        path: str,
        method: str = "GET",
        body: dict | None = None,
        *,
        query: dict | None = None,
        timeout_s: float = 5.0,
    ) -> dict:
        """As ``call``, through ``http`` (the caller's aiohttp session, which sends the token)."""
        url = self.url_for(path, query)
        try:
            async with http.request(
                method, url, json=body, headers=auth_headers(self.token), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                if r.status != 200:
                    text = (await r.text())[:200]
                    try:
                        reason = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        reason = text or r.reason
                    raise TrackerError(f"tracker {url}: {r.status} {reason}", r.status, str(reason))
                return await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise TrackerError(
                f"cannot reach tracker {url}: {str(exc) or type(exc).__name__}", None, "the tracker cannot be reached"
            ) from None

    async def aheartbeat(self, http: aiohttp.ClientSession, advertisement: dict) -> dict:
        """Advertise a node (``POST /nodes/heartbeat``); the tracker's answer (``ttl_s``: seconds it keeps it)."""
        return await self.acall(http, "nodes/heartbeat", "POST", advertisement)

    async def anodes(self, http: aiohttp.ClientSession, model: str) -> list[dict]:
        """As ``nodes``, on the event loop."""
        return (await self.acall(http, "nodes", query={"model": model}))["nodes"]

    async def aderegister(self, http: aiohttp.ClientSession, identity) -> None:
        """Remove this node (``identity``: its net.identity.NodeIdentity) from the tracker at shutdown: ``DELETE
        /nodes/{key}`` signed by the node (tracker/bans.py)."""
        at = round(time.time(), 3)
        sig = identity.sign(deregistration(identity.key_id, at))
        path = f"nodes/{quote(identity.key_id, safe='')}"
        await self.acall(http, path, "DELETE", query={"signed_at": at, "sig": sig}, timeout_s=3.0)

    async def aban(self, http: aiohttp.ClientSession, key: str, reason: str, evidence: dict | None = None) -> dict:
        """As ``ban``, on the event loop."""
        return await self.acall(http, "v1/bans", "POST", {"key": key, "reason": reason, "evidence": evidence or {}})

    async def abans(self, http: aiohttp.ClientSession, timeout_s: float = 5.0) -> list[dict]:
        """As ``bans``, on the event loop. TrackerError also for an answer that is not a list of bans."""
        body = await self.acall(http, "v1/bans", timeout_s=timeout_s)
        found = body.get("bans") if isinstance(body, dict) else None
        if not isinstance(found, list) or not all(isinstance(b, dict) and isinstance(b.get("key"), str) for b in found):
            raise TrackerError(f"tracker {self.url}: GET /v1/bans answered no list of bans", 200, "not a list of bans")
        return found
