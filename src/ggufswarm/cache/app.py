"""aiohttp app of the cache server (``ggufswarm cache``): store, fetch and look up prefix KV snapshots.

Endpoints (docs/protocol.md, "Snapshot cache"), all behind the swarm token:
``POST /v1/snapshots`` (a snapshot blob → 201 ``{key, n_tokens, bytes, blocks, evicted}``),
``GET /v1/snapshots/{key}`` (the blob, SHA-256 checked; header ``X-Ggufswarm-Sha256``),
``POST /v1/lookup`` (``{model, layers, dtype, tokens}`` → ``{key, length}``), ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from ..artifact.accounting import MAX_CONTEXT
from ..net.auth import token_middleware
from ..net.http import json_errors_middleware, read_json
from ..protocol.errors import ProtocolError
from ..protocol.snapshots import SHA_HEADER
from .snapshot import KV_DTYPES, STATE_DTYPE, Shard, valid_scope
from .store import SnapshotStore, SnapshotTooLarge

STORE = web.AppKey("store", SnapshotStore)
CONFIG = web.AppKey("config", object)
KEY_RE = re.compile(r"[0-9a-f]{64}")


@dataclass
class CacheConfig:
    """Cache server settings: blob directory, size cap (bytes), largest accepted upload (bytes)."""

    dir: str
    max_bytes: int = 4 * 2**30
    max_upload_bytes: int = 2**30
    token: str | None = None  # swarm token required on every endpoint (None: an open swarm)


async def put_snapshot(request: web.Request) -> web.Response:
    """``POST /v1/snapshots``: store a blob; 201 (200: the same bytes were already there), or 400 bad_snapshot /
    409 snapshot_exists (other bytes hold the key: the first upload stays) / 413 snapshot_too_large."""
    store = request.app[STORE]
    try:
        blob = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise SnapshotTooLarge(
            f"snapshot upload over {request.app[CONFIG].max_upload_bytes} bytes, this server's limit"
        ) from None
    info = await asyncio.get_running_loop().run_in_executor(None, store.put, blob)
    return web.json_response(info, status=200 if info["existing"] else 201)


async def get_snapshot(request: web.Request) -> web.Response:
    """``GET /v1/snapshots/{key}``: the blob (application/octet-stream); 404 unknown_snapshot, 410 snapshot_corrupt."""
    store = request.app[STORE]
    key = request.match_info["key"]
    if not KEY_RE.fullmatch(key):
        raise ProtocolError("bad_request", "a snapshot key is 64 lowercase hex digits")
    blob = await asyncio.get_running_loop().run_in_executor(None, store.get, key)
    return web.Response(
        body=blob, content_type="application/octet-stream", headers={SHA_HEADER: hashlib.sha256(blob).hexdigest()}
    )


def parse_lookup(body) -> tuple[Shard, list[int]]:
    """The shard and tokens of a lookup body ``{model, layers: [start, end], dtype, tokens[, scope]}``;
    ProtocolError."""
    if not isinstance(body, dict):
        raise ProtocolError("bad_request", "body must be a JSON object")
    model, layers, dtype, tokens = body.get("model"), body.get("layers"), body.get("dtype"), body.get("tokens")
    if not isinstance(model, str) or not re.fullmatch(r"[0-9a-f]{64}", model):
        raise ProtocolError("bad_request", "model must be the 64-hex-digit GGUF fingerprint")
    if not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(type(x) is int and 0 <= x <= 100_000 for x in layers)
        and layers[0] < layers[1]
    ):
        raise ProtocolError("bad_request", f"layers must be [start, end] with start < end, got {layers!r}")
    if dtype not in KV_DTYPES and dtype != STATE_DTYPE:
        raise ProtocolError(
            "bad_request", f"dtype must be one of {', '.join([*KV_DTYPES, STATE_DTYPE])}, got {dtype!r}"
        )
    if not (
        isinstance(tokens, list)
        and len(tokens) <= MAX_CONTEXT
        and all(type(t) is int and 0 <= t < 2**31 for t in tokens)
    ):
        raise ProtocolError("bad_request", f"tokens must be a list of at most {MAX_CONTEXT} non-negative int32 ids")
    scope = body.get("scope", "")
    if not valid_scope(scope):
        raise ProtocolError("bad_request", "scope must be empty or a 32-hex-digit session id")
    return Shard(model, layers[0], layers[1], dtype, scope), tokens


async def lookup(request: web.Request) -> web.Response:
    """``POST /v1/lookup``: the longest cached whole-block prefix → 200 ``{key, length}`` (``key`` null when none)."""
    store = request.app[STORE]
    shard, tokens = parse_lookup(await read_json(request))
    found = await asyncio.get_running_loop().run_in_executor(None, store.lookup, shard, tokens)
    key, length = found or (None, 0)
    return web.json_response({"key": key, "length": length})


def health_body(store: SnapshotStore) -> dict:
    s = store.stats
    return {
        "status": "ok",
        "snapshots": store.count,
        "bytes": store.total_bytes,
        "max_bytes": store.max_bytes,
        "hits": s.hits,
        "misses": s.misses,
        "evictions": s.evictions,
        "corrupt": s.corrupt,
        "refused": s.refused,
    }


async def health(request: web.Request) -> web.Response:
    """``GET /health``: counts, bytes held, hit/miss/eviction counters."""
    return web.json_response(health_body(request.app[STORE]))


def make_app(config: CacheConfig) -> web.Application:
    """The cache server's aiohttp app over a SnapshotStore in ``config.dir``. Raises OSError for a bad dir.

    Handlers raise their errors (ProtocolError, the store's typed errors); the shared middleware answers each
    with its JSON error (net/http.py)."""
    store = SnapshotStore(config.dir, config.max_bytes)
    app = web.Application(
        client_max_size=config.max_upload_bytes, middlewares=[token_middleware(config.token), json_errors_middleware()]
    )
    app[STORE] = store
    app[CONFIG] = config
    registry = CollectorRegistry()
    for name, doc, fn in (
        ("snapshots", "Snapshots stored", lambda: store.count),
        ("bytes", "Bytes of stored snapshots", lambda: store.total_bytes),
        ("hits", "Lookups that found a cached prefix", lambda: store.stats.hits),
        ("misses", "Lookups that found none", lambda: store.stats.misses),
        ("evictions", "Snapshots evicted (LRU, size cap)", lambda: store.stats.evictions),
        ("refused", "Uploads refused: another blob holds their key", lambda: store.stats.refused),
    ):
        Gauge(f"ggufswarm_cache_{name}", doc, registry=registry).set_function(fn)

    async def metrics(request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus text format."""
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/v1/snapshots", put_snapshot)
    app.router.add_get("/v1/snapshots/{key}", get_snapshot)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def close(_app) -> None:
        store.close()

    app.on_cleanup.append(close)
    return app


def run_cache(config: CacheConfig, host: str, port: int) -> int:
    """``ggufswarm cache``: serve until SIGINT/SIGTERM, printing one ready line to stdout."""
    from ..net.http import run_server

    app = make_app(config)
    store = app[STORE]

    def ready(url: str) -> None:
        print(
            f"ggufswarm cache ready: {url}  (dir {Path(config.dir).resolve()}, {store.count} snapshots, "
            f"{store.total_bytes / 2**20:.1f} of {config.max_bytes / 2**20:.0f} MiB)",
            flush=True,
        )

    run_server(app, host, port, ready)
    print("ggufswarm cache: stopped", file=sys.stderr, flush=True)
    return 0
