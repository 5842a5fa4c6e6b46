"""Routes: the nodes a session steps through (Hop, RemoteRoute), their validation, and the model's GGUF headers.

Each network call has a coroutine (``RemoteRoute.connect``, ``RemoteRoute.aopen``, ``afetch_model_headers``) and a
blocking form that runs it on the shared route loop (client/loop.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from ..net.link import check_url, request
from . import loop
from .transport import call, check_reply, new_http_session

HEALTH_TIMEOUT_S = 10.0  # most seconds a node's /health may take when a route is described
HEADER_TIMEOUT_S = 30.0  # default seconds per request of a model-header download


@dataclass(frozen=True)
class Hop:
    """One node of a route, as its ``/health`` describes it."""

    url: str
    start: int
    end: int
    embed: bool
    head: bool
    n_embd: int
    n_layers: int
    max_length: int
    max_step_tokens: int
    model_fingerprint: str | None = None  # SHA-256 of the model's GGUF headers (None: a node that does not say)
    model_name: str | None = None
    cache: bool | None = None  # whether the node has a snapshot cache (None: it does not say)
    max_verify_tokens: int | None = None  # head: most tokens of a speculative verify step (None: it cannot verify)
    path: str = "direct"  # how it is reached: "direct", "mapped" (a home router's mapped port) or "relayed"
    node_id: str | None = None  # the node's key (64 hex, its advertisement's ``node_id``; None: not known)

    @classmethod
    def from_advertisement(cls, ad: dict) -> Hop | None:
        """The Hop a tracker advertisement describes (``url``, ``layers``, ``embed``, ``head`` and
        ``extra.hop``), or None when it lacks a field (a node that does not advertise them: ask its /health)."""
        hop = (ad.get("extra") or {}).get("hop")
        if not isinstance(hop, dict):
            return None
        try:
            return cls(
                str(ad["url"]).rstrip("/"),
                int(ad["layers"][0]),
                int(ad["layers"][1]),
                bool(ad["embed"]),
                bool(ad["head"]),
                **{k: hop[k] for k in ("n_embd", "n_layers", "max_length", "max_step_tokens")},
                model_fingerprint=hop.get("model_fingerprint"),
                model_name=hop.get("model_name"),
                cache=hop.get("cache"),
                max_verify_tokens=hop.get("max_verify_tokens"),
                path=str(((ad.get("extra") or {}).get("reach") or {}).get("path", "direct")),
                node_id=str(ad["node_id"]) if ad.get("node_id") else None,
            )
        except (KeyError, TypeError, ValueError, IndexError):
            return None

    @classmethod
    def from_health(cls, url: str, h: dict) -> Hop:
        """The Hop node ``url``'s ``/health`` body ``h`` describes (KeyError for a missing field)."""
        return cls(
            url,
            h["layers"][0],
            h["layers"][1],
            h["embed"],
            h["head"],
            h["n_embd"],
            h["n_layers"],
            h["max_length"],
            h["max_step_tokens"],
            h.get("model_fingerprint"),
            h.get("model_name"),
            bool(h["cache"]) if "cache" in h else None,
            h.get("max_verify_tokens"),
            str((h.get("reach") or {}).get("path", "direct")),
            str(h["node_id"]) if h.get("node_id") else None,
        )


async def describe_hops(
    urls: list[str], timeout_s: float, token: str | None, http: aiohttp.ClientSession | None = None
) -> list[Hop]:
    """Ask every node of ``urls`` for its ``/health`` at once: their Hops in order. RouteError (the first
    failure in route order) when one is unreachable or refuses; ValueError for a malformed URL."""
    urls = [check_url(u) for u in urls]
    own = http is None
    http = http or new_http_session()
    try:

        async def one(url: str) -> Hop:
            return Hop.from_health(
                url, await call(http, url, "GET", "/health", None, "health", token=token, timeout=timeout_s)
            )

        results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
    finally:
        if own:
            await http.close()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class RemoteRoute:
    """An ordered list of node URLs whose shards cover ``[0, n_layers)``, embed first, head last.

    ``hop_timeout_s``: seconds one hop may take to answer. Node i of n waits ``(n - 1 - i) x`` that for
    its next hop, and the client ``n x`` that (+1 s) for the first node, so the deepest failing hop
    times out first and the error names it; both scale with a frame's size (``step_timeout_s``: x1 up to
    512 tokens, x8 for 4096). Raises RouteError when a node is unreachable and
    ValueError when the shards do not chain or serve different models. ``part=True`` accepts a chain
    covering only some layers (the replacement for a failed hop's span). ``model``: the GGUF fingerprint
    (``GGUFModelFile.fingerprint``) the client's tokenizer is for; every node must serve it (ValueError
    naming both models otherwise), and sessions are opened with it (``model_mismatch`` from a node that
    has changed since). ``token``: the swarm token, sent on every request to the route's nodes (None: an open
    swarm).

    The constructor asks each node's ``/health`` (blocking, on the shared route loop); ``await
    RemoteRoute.connect(...)`` does the same on the caller's loop.
    """

    def __init__(
        self,
        urls: list[str],
        hop_timeout_s: float = 30.0,
        part: bool = False,
        model: str | None = None,
        *,
        token: str | None = None,
    ):
        if not urls:
            raise ValueError("a route needs at least one node URL")
        hops = loop.run(describe_hops(urls, min(hop_timeout_s, HEALTH_TIMEOUT_S), token))
        self._init(hops, hop_timeout_s, part, model, token)

    @classmethod
    async def connect(
        cls,
        urls: list[str],
        hop_timeout_s: float = 30.0,
        *args,
        token: str | None = None,
        http: aiohttp.ClientSession | None = None,
        **kwargs,
    ) -> RemoteRoute:
        """The route over ``urls``, described by their ``/health`` on the running loop: the constructor's arguments
        (``part`` and ``model`` go to ``of_hops``), and ``http``, the aiohttp session to ask with (a short-lived
        one of its own by default). Raises as the constructor."""
        if not urls:
            raise ValueError("a route needs at least one node URL")
        hops = await describe_hops(urls, min(hop_timeout_s, HEALTH_TIMEOUT_S), token, http)
        return cls.of_hops(hops, hop_timeout_s, *args, token=token, **kwargs)

    @classmethod
    def of_hops(
        cls,
        hops: list[Hop],
        hop_timeout_s: float,
        part: bool = False,
        model: str | None = None,
        *,
        token: str | None = None,
    ) -> RemoteRoute:
        """A route over already described hops (no /health calls; ``part``, ``model`` and ``token`` as in the
        constructor); ValueError when they do not chain or serve another model."""
        route = cls.__new__(cls)
        route._init(list(hops), hop_timeout_s, part, model, token)
        return route

    def _init(self, hops: list[Hop], hop_timeout_s: float, part: bool, model: str | None, token: str | None) -> None:
        self.hop_timeout_s = hop_timeout_s
        self.token = token
        self.hops = hops
        self.timeout_s = self.hop_timeout_s * len(self.hops) + 1.0
        # One model end to end: every node's GGUF fingerprint equals ``model`` (the client's) when given, else
        # each other's. Sessions then open with it, so a node since restarted with another model refuses them.
        said = [h for h in hops if h.model_fingerprint is not None]
        self.model = model or (said[0].model_fingerprint if said else None)
        other = next((h for h in said if h.model_fingerprint != self.model), None)
        if other is not None:
            mine = next((h for h in said if h.model_fingerprint == self.model), None)
            want = f"{mine.model_name} ({self.model[:12]}, at {mine.url})" if mine else f"model {self.model[:12]}"
            raise ValueError(
                f"node {other.url} serves {other.model_name} (GGUF fingerprint "
                f"{other.model_fingerprint[:12]}), not {want}: a route serves one model"
            )
        first, last = self.hops[0], self.hops[-1]
        if not part and (not first.embed or not last.head or first.start != 0 or last.end != last.n_layers):
            raise ValueError(
                f"route must start at layer 0 with the embedding stage and end at layer "
                f"{last.n_layers} with the head; got {self.describe()}"
            )
        for a, b in zip(self.hops, self.hops[1:]):
            if a.end != b.start or a.head or b.embed:
                raise ValueError(f"route does not chain at {a.url} ({a.start}:{a.end}) → {b.url} ({b.start}:{b.end})")

    def describe(self) -> list[dict]:
        """``[{"node": URL, "layers": [start, end]}, ...]`` in route order."""
        return [{"node": h.url, "layers": [h.start, h.end]} for h in self.hops]

    @property
    def max_length(self) -> int:
        """The longest session every node of the route can hold (tokens)."""
        return min(h.max_length for h in self.hops)

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step may carry on this route (the smallest node limit)."""
        return min(h.max_step_tokens for h in self.hops)

    async def aopen(self, max_length: int, *args, **kwargs):
        """Open an AsyncRouteSession on every node (head first) on the running loop; RouteError (with the
        node's status) when one refuses. The same arguments as ``AsyncRouteSession`` after its route:
        ``max_length, sampling=None, wire_dtype="f32", top_logprobs=0, replan=None, reuse_prefix=True,
        lease_s=None, logprobs=False, *, http=None, commit=False, ring=True`` (what each does:
        ``AsyncRouteSession.__init__``)."""
        from .session import AsyncRouteSession

        return await AsyncRouteSession.open(self, max_length, *args, **kwargs)

    def open(self, max_length: int, *args, **kwargs):
        """``aopen`` on the shared route loop: a blocking RemoteSession (same arguments but ``http``, the shared
        loop's; ``replan`` may be a plain function)."""
        from .blocking import RemoteSession

        async def opening():
            return await self.aopen(max_length, *args, http=await loop.shared_http(), **kwargs)

        return RemoteSession(loop.run(opening()))


async def afetch_model_headers(
    url: str,
    data_dir: Path,
    timeout: float = HEADER_TIMEOUT_S,
    *,
    token: str | None = None,
    http: aiohttp.ClientSession | None = None,
) -> tuple[Path, dict]:
    """The model node ``url`` serves, for a client without its GGUF: ``GET /v1/model``, then each file's header
    (``GET /v1/model/header/{i}``) written into a sparse file of the file's full size under
    ``data_dir/models/<fingerprint[:16]>/`` (reused when already there). Enough for the vocabulary and chat
    template (llama.cpp's vocab-only load), not for weights. ``token``: the swarm token; ``timeout``: seconds
    per request. Returns (first file's path, the /v1/model body).

    Raises RouteError (node unreachable, refused, or no /v1/model) and ValueError (the headers do not hash to
    the fingerprint the node gave).
    """
    from ..artifact.gguf_file import GGUFModelFile

    url = check_url(url)
    own = http is None
    http = http or new_http_session()
    try:
        info = check_reply(url, *await request(http, url, "GET", "/v1/model", token=token, timeout=timeout), "model")
        folder = Path(data_dir) / "models" / str(info["fingerprint"])[:16]
        paths = [folder / Path(f["name"]).name for f in info["files"]]
        if not all(p.is_file() and p.stat().st_size == f["bytes"] for p, f in zip(paths, info["files"])):
            folder.mkdir(parents=True, exist_ok=True)
            for i, (path, f) in enumerate(zip(paths, info["files"])):
                status, header = await request(http, url, "GET", f"/v1/model/header/{i}", token=token, timeout=timeout)
                if status != 200 or len(header) != f["header_bytes"]:
                    check_reply(url, status if status >= 400 else 502, header[:200], f"model header {i}")
                with open(path, "wb") as out:
                    out.write(header)
                    out.truncate(f["bytes"])  # sparse: the tensor data is never read
    finally:
        if own:
            await http.close()
    fingerprint = await asyncio.to_thread(lambda: GGUFModelFile(paths[0]).fingerprint)
    if fingerprint != info["fingerprint"]:
        raise ValueError(f"the model headers from {url} do not match its fingerprint {info['fingerprint'][:12]}")
    return paths[0], info


def fetch_model_headers(
    url: str, data_dir: Path, timeout: float = HEADER_TIMEOUT_S, *, token: str | None = None
) -> tuple[Path, dict]:
    """``afetch_model_headers`` on the shared route loop (blocking)."""
    return loop.run(afetch_model_headers(url, data_dir, timeout, token=token))


__all__ = ["Hop", "RemoteRoute", "afetch_model_headers", "describe_hops", "fetch_model_headers"]
