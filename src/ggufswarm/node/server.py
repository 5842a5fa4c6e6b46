"""aiohttp app of a node: ``make_app(config)`` serves one shard; ``run_node`` is the ``ggufswarm node`` command.

Endpoints (docs/protocol.md): ``POST /v1/sessions`` (open), ``POST /v1/step`` (a frame: prefill or
decode), ``POST /v1/sessions/{id}/truncate``, ``DELETE /v1/sessions/{id}``, ``GET /health``,
``GET /metrics``, ``POST /v1/sessions/{id}/restore`` (fill from the snapshot cache). A non-head
node pushes its output frame straight to the session's next hop and answers with the head's reply, its own hop timings prepended.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..artifact.default_model import model_name, resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..protocol import PROTOCOL_VERSION, Frame, ProtocolError, decode_frame, encode_hidden
from ..protocol.auth import auth_headers, token_middleware
from ..protocol.fields import json_field
from ..protocol.frame import FLAG_NO_SAMPLE, FLAG_REWIND, FLAG_VERIFY, HEADER_SIZE, WIRE_DTYPES, step_timeout_s
from ..protocol.http import JSON, as_protocol_error, json_errors_middleware, read_json, run_server
from ..runtime.sampling import SamplingParams
from .link import HopLinks, encode_reply, reply_error
from ..runtime.sessions import Session, SessionStore, StepRecord
from ..runtime.backends import DEFAULT_BACKEND, load_shard, model_config
from ..runtime.spec import ShardSpec

MAX_STEP = 2 ** 63 - 1  # step numbers are uint64 in a frame's header; JSON ones stay below 2**63
NODE = web.AppKey("node", object)
# --batch-group up to this: llama.cpp sessions batched together stay bitwise their runs alone (LlamaCppShard.batch_group);
# above it the node's throughput mode: one unified KV stream, so that any of its sessions share a ubatch
EXACT_BATCH_GROUP = 3


@dataclass
class NodeConfig:
    """Settings of one node. ``layers``: ``"START:END"`` (half-open). Units: seconds, tokens, MiB."""

    layers: str
    embed: bool = False
    head: bool = False
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"            # torch backend's compute dtype
    backend: str = DEFAULT_BACKEND    # "llama.cpp" or "torch" (runtime.backends)
    threads: int | None = None        # llama.cpp decode/batch threads (None: all cores)
    ctx_size: int = 8192              # llama.cpp: KV cells per session = the longest session (tokens)
    max_sessions: int = 4             # llama.cpp: sessions at once (sequence ids of the context)
    batch_group: int = 3              # llama.cpp: most sessions per shared ubatch (<= 3: bitwise as alone; more:
                                      # one unified KV stream, any sessions batch together, not bitwise)
    kv_budget_tokens: int = 262144
    kv_budget_mb: float | None = None
    session_ttl_s: float = 300.0
    hop_timeout_s: float = 30.0
    max_step_tokens: int = 4096
    workers: int = 4
    exit_with_parent: bool = False
    tracker: str | None = None       # with a tracker: ``model`` is a published name, fetched from the swarm
    data_dir: str = "ggufswarm-data"  # where swarm-fetched shards are stored (sparse files)
    heartbeat_s: float = 5.0
    swarm_name: str | None = None     # the published name advertised to the tracker (set after a fetch)
    memory_budget_mb: float = 8192.0  # with layers "auto": most MiB of block weights (encoded) to take on
    fetch_timeout_s: float = 1800.0   # with a tracker: the shard fetch fails after this long in all
    fetch_stall_s: float = 60.0       # with a tracker: warn and retry when the fetch gets no piece this long
    token: str | None = None          # swarm token: required on every endpoint, sent to tracker, hops, cache
    cache: str | None = None          # snapshot cache server URL (``ggufswarm cache``)
    snapshot_every: int = 32          # with a cache: snapshot each session every N tokens after its prefill
    state_checkpoints: int = 4        # llama.cpp exact-state shards: session states kept to truncate to


class NodeState:
    """Everything a node's handlers share: the shard, its session store, metrics, the next-hop client."""

    def __init__(self, config: NodeConfig, executor):
        self.config = config
        self.executor = executor
        self.node_id = uuid.uuid4().hex
        self.url = ""
        self.spec = executor.spec
        self.cfg = executor.cfg
        budget = config.kv_budget_tokens
        if executor.backend == "llama.cpp":  # the context's cells are the budget: allocated up front
            budget = min(budget, executor.n_ctx_seq * executor.n_seq_max)
        self.store = SessionStore(executor, budget, config.session_ttl_s)
        if config.kv_budget_mb is not None:
            per_token = max(self.store.kv_bytes_per_token(), 1)
            self.store.budget_tokens = min(budget, int(config.kv_budget_mb * 2 ** 20) // per_token)
        # The longest session one open may reserve, so that no single request (a huge max_tokens) takes the whole
        # KV budget: llama.cpp, one sequence's cells (--ctx-size, at most 1/--max-sessions of the budget: see
        # load_executor); torch, the same rule over its token budget.
        cap = getattr(executor, "n_ctx_seq", None)
        if cap is None:
            cap = min(config.ctx_size, max(self.store.budget_tokens // config.max_sessions, 1))
        self.store.max_session_tokens = self.max_session_tokens = min(self.cfg.max_length, cap)
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="shard")
        # a shard whose steps serialize on one lock (llama.cpp: one context) runs idle decode steps inline (see step)
        self.inline_lock = getattr(executor, "step_lock", None)
        # llama.cpp: steps of different sessions arriving while the shard is busy run together (node/batching.py)
        self.batcher = None
        if hasattr(executor, "forward_batch") and self.inline_lock is not None:
            from .batching import StepBatcher
            if config.batch_group < 1:
                raise ValueError(f"--batch-group must be at least 1, got {config.batch_group}")
            executor.batch_group = config.batch_group
            self.batcher = StepBatcher(self.store, self.pool)
        self.active_sessions = 0  # sessions with a step in flight here (their stepping > 0)
        # link messages read but not yet started: the steps of several sessions that arrived while the shard computed
        # (one loop iteration reads them all, their tasks then start one after another; see _apply)
        self.frames_waiting = 0
        self.capacity_changed: asyncio.Event | None = None  # set by readvertise(); the heartbeat loop's (see there)
        self.client: aiohttp.ClientSession | None = None
        self.links = HopLinks(lambda: self.client)  # to next hops (node/link.py)
        self.links_in: set[web.WebSocketResponse] = set()  # from previous hops
        self.link_tasks: set[asyncio.Task] = set()  # frames from links being applied
        # head: a client's reply link per session (GET /v1/link?replies=<session id>): each step's reply goes
        # there too, straight from the head, before it goes back along the route
        self.reply_links: dict[uuid.UUID, web.WebSocketResponse] = {}
        self.peers: set[str] = set()  # node URLs the tracker listed for this model (next_hop check), and when
        self.peers_at = 0.0
        self.snapshots = None
        if config.cache:
            from .snapshots import SnapshotLink, shard_of
            self.snapshots = SnapshotLink(config.cache, shard_of(executor), config.snapshot_every, lambda: self.client,
                                          executor, self.node_id)
        # most tokens in one step: --max-step-tokens, at most what the backend takes in one call (llama.cpp: n_batch)
        self.max_step_tokens = min(config.max_step_tokens, getattr(executor, "n_batch", None) or config.max_step_tokens)
        self.max_body = HEADER_SIZE + self.max_step_tokens * (self.cfg.n_embd * 4 + 4)
        reg = self.registry = CollectorRegistry()
        store = self.store
        Gauge("ggufswarm_node_sessions_open", "Route sessions open on this node", registry=reg).set_function(
            lambda: len(store.sessions))
        Gauge("ggufswarm_node_kv_tokens_held", "Tokens held in KV caches (all sessions)", registry=reg).set_function(
            lambda: store.held_tokens)
        Gauge("ggufswarm_node_kv_tokens_reserved", "Tokens reserved by open sessions (sum of max_length)",
              registry=reg).set_function(lambda: store.reserved_tokens)
        Gauge("ggufswarm_node_kv_budget_tokens", "KV budget of this node in tokens", registry=reg).set_function(
            lambda: store.budget_tokens)
        self.steps = Counter("ggufswarm_node_steps", "Steps applied", ["kind"], registry=reg)
        self.step_seconds = Histogram("ggufswarm_node_step_seconds", "Step compute time (this shard only)", ["kind"],
                                      registry=reg, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5,
                                                             5, 10, 30))
        self.bytes_in = Counter("ggufswarm_node_payload_bytes_in", "Frame bytes received (header + payload)",
                                ["kind"], registry=reg)
        self.bytes_out = Counter("ggufswarm_node_payload_bytes_out", "Frame bytes pushed to the next hop",
                                 ["kind"], registry=reg)
        self.replays = Counter("ggufswarm_node_step_replays", "Retried steps answered without re-applying",
                               registry=reg)
        self.errors = Counter("ggufswarm_node_errors", "Requests answered with an error", ["code"], registry=reg)
        for kind in ("prefill", "decode"):  # export the series before the first step
            for metric in (self.steps, self.step_seconds, self.bytes_in, self.bytes_out):
                metric.labels(kind)

    @property
    def max_verify_tokens(self) -> int | None:
        """The head's most tokens in a speculative verify step (FLAG_VERIFY: every row's logits); None elsewhere."""
        if not self.spec.head:
            return None
        return min(getattr(self.executor, "max_outputs", self.max_step_tokens), self.max_step_tokens)

    def readvertise(self) -> None:
        """Sessions opened, closed or expired: have the heartbeat loop send the new free KV to the tracker now, not
        at its next beat (a swarm just freed by a burst of requests was refused as full for up to a beat)."""
        if self.capacity_changed is not None:
            self.capacity_changed.set()

    def totals(self) -> dict:
        """Plain counters for /health (read from the Prometheus registry, so a test need not parse its text)."""
        def value(name: str, kind: str | None = None) -> int:
            return int(self.registry.get_sample_value(name, {"kind": kind} if kind else {}) or 0)

        out = {"replays": value("ggufswarm_node_step_replays_total"),
               "errors": int(sum(m.value for f in self.registry.collect() if f.name == "ggufswarm_node_errors"
                                 for m in f.samples if m.name.endswith("_total")))}
        for kind in ("decode", "prefill"):
            out[kind + "_steps"] = value("ggufswarm_node_steps_total", kind)
            out["bytes_in_" + kind] = value("ggufswarm_node_payload_bytes_in_total", kind)
            out["bytes_out_" + kind] = value("ggufswarm_node_payload_bytes_out_total", kind)
        out["steps"] = out["decode_steps"] + out["prefill_steps"]
        return out

    @property
    def model_name(self) -> str:
        """The model's name: the published name with a tracker, else the alias it was started with (smollm2) or the
        GGUF file name without its extension (artifact.default_model.model_name)."""
        return self.config.swarm_name or model_name(self.config.model, self.executor.model.path)

    def health(self) -> dict:
        """The ``/health`` body: shard, model shape, limits and counters."""
        s = self.store
        return {
            "status": "ok", "protocol": PROTOCOL_VERSION, "node_id": self.node_id, "model": self.executor.model.path.name,
            "model_name": self.model_name, "model_fingerprint": self.executor.model.fingerprint,
            "arch": self.cfg.arch, "n_layers": self.cfg.n_layers, "n_embd": self.cfg.n_embd,
            "n_vocab": self.cfg.n_vocab, "backend": self.executor.backend,
            "max_length": self.max_session_tokens,
            "layers": [self.spec.start, self.spec.end], "embed": self.spec.embed, "head": self.spec.head,
            "max_step_tokens": self.max_step_tokens, "hop_timeout_s": self.config.hop_timeout_s,
            "max_verify_tokens": self.max_verify_tokens,
            "session_ttl_s": s.ttl_s, "sessions": len(s.sessions), "kv_budget_tokens": s.budget_tokens,
            "kv_tokens_reserved": s.reserved_tokens, "kv_tokens_held": s.held_tokens,
            "kv_bytes_per_token": s.kv_bytes_per_token(), **self.totals(),
            "cache": self.config.cache, "snapshots": self.snapshots.counters if self.snapshots else None,
            "links": {"in": len(self.links_in), "replies": len(self.reply_links), **self.links.counts()},
            "batching": None if self.batcher is None else {"batch_group": self.config.batch_group,
                                                           **self.batcher.counters()},
        }


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj).encode(), status=status, content_type=JSON)


def _error_reply(state: NodeState, exc: Exception) -> tuple[int, bytes]:
    """(HTTP status, JSON error body) for ``exc`` (as_protocol_error; a ValueError without a protocol code is the
    request's fault: ``bad_request``); counted in the node's error metric."""
    if isinstance(exc, ValueError) and getattr(exc, "code", None) is None and not isinstance(exc, UnicodeError):
        err = ProtocolError("bad_request", str(exc))
    else:
        err = as_protocol_error(exc)
    state.errors.labels(err.code).inc()
    return err.status, err.body()


def _error(state: NodeState, exc: Exception) -> web.Response:
    status, body = _error_reply(state, exc)
    return web.Response(body=body, status=status, content_type=JSON)


def _session_id(text) -> uuid.UUID:
    try:
        return uuid.UUID(str(text))
    except ValueError:
        raise ProtocolError("bad_request", f"session_id must be a UUID, got {text!r}") from None


async def open_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions`` {session_id, max_length, next_hop, sampling, wire_dtype, top_logprobs, logprobs,
    lease_s, hop_timeout_s, model} → 201; ``model`` (optional): the GGUF fingerprint the client expects, 409
    ``model_mismatch`` when this node serves another model."""
    state: NodeState = request.app[NODE]
    try:
        body = await read_json(request)
        sid = _session_id(body.get("session_id") or uuid.UUID(bytes=os.urandom(16)))  # 128 random bits
        max_length = json_field(body, "max_length", int)
        next_hop = _next_hop(state, body.get("next_hop"))
        await _check_registered(state, next_hop)
        wire = body.get("wire_dtype", "f32")
        if wire not in WIRE_DTYPES:
            raise ProtocolError("bad_dtype", f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire!r}")
        n_logprobs = json_field(body, "top_logprobs", int, 0, min=0, max=20)
        want_logprob = json_field(body, "logprobs", bool, False)
        lease = json_field(body, "lease_s", float, None, positive=True, unit="seconds")
        hop_timeout = json_field(body, "hop_timeout_s", float, state.config.hop_timeout_s, positive=True,
                                 unit="seconds")
        model = body.get("model")
        if model is not None and model != state.executor.model.fingerprint:
            raise ProtocolError("model_mismatch", f"this node serves {state.model_name} (GGUF fingerprint "
                                                  f"{state.executor.model.fingerprint[:12]}), the session is for "
                                                  f"another model (fingerprint {str(model)[:12]})")
        sampling = body.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise ProtocolError("bad_request", "sampling must be an object")
        try:
            params = SamplingParams(**sampling).validate()
        except TypeError as exc:
            raise ProtocolError("bad_request", f"sampling: {exc}") from None
        session = state.store.open(sid, max_length, next_hop, params, wire, n_logprobs, want_logprob)
        session.lock = asyncio.Lock()
        session.hop_timeout_s = float(hop_timeout)
        session.lease_s = lease
    except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
        return _error(state, exc)
    state.readvertise()
    return _json({"session_id": str(sid), "max_length": max_length, "layers": [state.spec.start, state.spec.end],
                  "kv_tokens_reserved": state.store.reserved_tokens, "kv_budget_tokens": state.store.budget_tokens},
                 201)


async def renew_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/renew`` → 200 {session_id, lease_s}: the client is alive; the session's idle
    clock restarts (its lease, or the node's session TTL, counts from now). 404 unknown_session."""
    state: NodeState = request.app[NODE]
    try:
        session = state.store.get(_session_id(request.match_info["sid"]))
        session.last_used = time.monotonic()
    except Exception as exc:  # noqa: BLE001
        return _error(state, exc)
    return _json({"session_id": str(session.id), "lease_s": session.lease_s or state.store.ttl_s})


async def close_session(request: web.Request) -> web.Response:
    """``DELETE /v1/sessions/{id}`` → 200 {closed, kv_tokens}; 404 unknown_session."""
    state: NodeState = request.app[NODE]
    try:
        session = state.store.close(_session_id(request.match_info["sid"]))
    except Exception as exc:  # noqa: BLE001
        return _error(state, exc)
    state.readvertise()
    replies = state.reply_links.pop(session.id, None)
    if replies is not None:
        await replies.close()
    return _json({"closed": str(session.id), "kv_tokens": session.length})


def _next_hop(state: NodeState, next_hop) -> str | None:
    """A validated next_hop for this shard: None on the head, the next node's ``http(s)://HOST:PORT`` otherwise
    (no path, query, fragment or user info: a node posts frames, with the swarm token, only to another node's
    endpoints). ProtocolError bad_request otherwise."""
    if state.spec.head and next_hop:
        raise ProtocolError("bad_request", "this node holds the head stage; it takes no next_hop")
    if state.spec.head:
        return None
    bad = not (isinstance(next_hop, str) and len(next_hop) <= 2048)
    if not bad:
        try:
            parts = urlsplit(next_hop)
            bad = (parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None
                   or parts.username is not None or parts.password is not None or parts.path not in ("", "/")
                   or parts.query or parts.fragment or "?" in next_hop or "#" in next_hop)
        except ValueError:  # a port out of range or not a number
            bad = True
    if bad:
        raise ProtocolError("bad_request", f"layers {state.spec.start}:{state.spec.end} are not the last shard: "
                                           f"next_hop must be the next node's http://HOST:PORT (no path, query "
                                           f"or user info), got {next_hop!r}"[:300])
    return next_hop.rstrip("/")


async def _check_registered(state: NodeState, url: str | None) -> None:
    """With a tracker, a next_hop must be a node the tracker lists for this node's model (the list is cached
    for 5 s and fetched again on a miss). ProtocolError next_hop_unknown (403) or tracker_unavailable (503)."""
    if url is None or not state.config.tracker:
        return
    now = time.monotonic()
    if url in state.peers and now - state.peers_at < 5.0:
        return
    model = state.config.swarm_name or state.config.model or ""
    try:
        async with state.client.get(state.config.tracker.rstrip("/") + "/nodes", params={"model": model},
                                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            listed = (await resp.json())["nodes"]
        state.peers = {str(n["url"]).rstrip("/") for n in listed}
        state.peers_at = now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise ProtocolError("tracker_unavailable", f"cannot check next_hop {url} with the tracker: "
                                                   f"{type(exc).__name__}") from None
    if url not in state.peers:
        raise ProtocolError("next_hop_unknown", f"next_hop {url} is not a node the tracker lists for model "
                                                f"{model!r}; refused")


async def truncate_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/truncate`` {length[, step][, next_hop]} → 200 {length}: roll the KV cache back.

    Route repair also sets ``step`` (the last step number applied; the next is ``step + 1``) and, for a
    node whose successor was replaced, ``next_hop``.
    """
    state: NodeState = request.app[NODE]
    try:
        body = await read_json(request)
        length = json_field(body, "length", int)
        step_no = json_field(body, "step", int, None, min=0, max=MAX_STEP)
        next_hop = _next_hop(state, body["next_hop"]) if "next_hop" in body else None
        await _check_registered(state, next_hop)
        session = state.store.get(_session_id(request.match_info["sid"]))
        async with session.lock:
            state.store.truncate(session.id, length)
            if step_no is not None:
                state.store.set_step(session, step_no)
            if "next_hop" in body:
                session.next_hop = next_hop
    except Exception as exc:  # noqa: BLE001
        return _error(state, exc)
    return _json({"session_id": str(session.id), "length": session.length})


async def restore_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions/{id}/restore`` {tokens[, step][, boundaries]} → 200 {length, reason[, boundaries]}:
    fill an empty session's KV cache with the longest cached prefix of ``tokens`` from the snapshot cache.

    On a llama.cpp node the prefix ends where a step of the cached computation ended, and the reply's
    ``boundaries`` lists those step ends (up to ``length``): the route keeps only a prefix all its nodes
    restored with the same steps. ``boundaries`` in the request (a route repair: the session's step ends)
    restores only a prefix computed with exactly those steps (SnapshotLink.fetch).

    ``length`` 0 when there is no cache, no cached prefix, or the cache fails (the caller recomputes).
    409 session_not_empty when the session already holds tokens; 400 bad_token for ids out of vocabulary,
    bad_request for boundaries that are not ascending positions.
    """
    state: NodeState = request.app[NODE]
    t0 = time.perf_counter()
    try:
        body = await read_json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ProtocolError("bad_request", "tokens must be a list of token ids")
        step_no = json_field(body, "step", int, None, min=0, max=MAX_STEP)
        wanted = body.get("boundaries")
        if wanted is not None and (not isinstance(wanted, list) or not all(type(b) is int for b in wanted)
                                   or wanted != sorted(set(wanted)) or (wanted and wanted[0] <= 0)):
            raise ProtocolError("bad_request", "boundaries must be ascending positive token positions")
        session = state.store.get(_session_id(request.match_info["sid"]))
        if len(tokens) > session.max_length:
            raise ProtocolError("context_overflow", f"{len(tokens)} tokens exceed the session's max_length "
                                                    f"{session.max_length}")
        if tokens and not 0 <= min(tokens) <= max(tokens) < state.cfg.n_vocab:
            raise ProtocolError("bad_token", f"token id out of range [0, {state.cfg.n_vocab})")
        async with session.lock:
            if session.length:
                raise ProtocolError("session_not_empty", f"session holds {session.length} tokens; restore needs "
                                                         "an empty session (truncate to 0 first)")
            snap, length, reason = (None, 0, "no cache configured") if state.snapshots is None else \
                await state.snapshots.fetch(tokens, wanted)
            n = length
            if snap is not None and snap.state is not None:  # llama.cpp: the whole state, then the shared prefix
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        state.pool, state.executor.load_state, session.kv, snap.state, snap.n_tokens)
                    if n < snap.n_tokens:
                        session.kv.truncate(n)
                except (RuntimeError, ValueError) as exc:  # e.g. taken by a node with other --max-sessions
                    snap, reason = None, f"snapshot not loadable here: {exc}"
                    if session.length:  # loaded but not cut back (a recurrent shard refuses the cut): start empty
                        session.kv.truncate(0)
            elif snap is not None:
                session.kv.load([k[:n] for k in snap.keys], [v[:n] for v in snap.values])
            if snap is not None:
                session.history[:] = tokens[:n]
                session.boundaries[:] = [b for b in snap.boundaries if b <= n]
                session.grouping_cut = bool(n) and n not in session.boundaries  # torch: any prefix restores
                session.history_complete = True
                session.snapshot_at = n
                state.snapshots.counters["restored"] += 1
                state.snapshots.counters["restored_tokens"] += n
            if step_no is not None:
                state.store.set_step(session, step_no)
    except Exception as exc:  # noqa: BLE001
        return _error(state, exc)
    reply = {"session_id": str(session.id), "length": session.length, "reason": reason,
             "ms": round((time.perf_counter() - t0) * 1e3, 3)}
    if state.executor.backend == "llama.cpp":
        reply["boundaries"] = session.boundaries
    return _json(reply)


def _frame_too_large(state: NodeState) -> ProtocolError:
    return ProtocolError("too_many_tokens", f"frame body over {state.max_body} bytes: more than "
                                            f"max_step_tokens {state.max_step_tokens} tokens")


async def step(request: web.Request) -> web.Response:
    """``POST /v1/step``: one frame (application/octet-stream) → 200 JSON ``{token, logprobs, hops}``."""
    state: NodeState = request.app[NODE]
    t0 = time.perf_counter()
    try:
        if (request.content_length or 0) > state.max_body + 1024:
            raise _frame_too_large(state)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _frame_too_large(state) from None
    except Exception as exc:  # noqa: BLE001
        return _error(state, exc)
    status, reply = await _apply_frame(state, body, t0)
    return web.Response(body=reply, status=status, content_type=JSON)


async def link(request: web.Request) -> web.StreamResponse:
    """``GET /v1/link``: a WebSocket on which a previous hop sends step frames (binary messages, each the
    body of a ``POST /v1/step``); each is answered by one binary message (node/link.py: frame key, status,
    JSON reply). Frames are applied concurrently, each session's in order; a bad frame gets its error
    reply and the link stays open.

    ``GET /v1/link?replies=<session id>`` (head only, an open session): the client's **reply link**. The head
    sends each successful step reply of that session on it as well (same message), as soon as it has it,
    before the reply travels back along the route: the client has the token one message after the head
    sampled it instead of one per hop. A later reply link for the session replaces the earlier one."""
    state: NodeState = request.app[NODE]
    ws = web.WebSocketResponse(max_msg_size=state.max_body + 1024, autoping=True)
    if not ws.can_prepare(request).ok:
        return _error(state, ProtocolError("bad_request", "GET /v1/link opens a WebSocket: send Connection: Upgrade "
                                                          "and Upgrade: websocket (docs/protocol.md, \"Links\")"))
    if "replies" in request.query:
        try:
            if not state.spec.head:
                raise ProtocolError("bad_request", "only the head sends replies: a reply link goes to the node "
                                                   "with --head")
            sid = state.store.get(_session_id(request.query["replies"])).id
        except Exception as exc:  # noqa: BLE001
            return _error(state, exc)
        return await _reply_link(state, ws, request, sid)
    await ws.prepare(request)
    state.links_in.add(ws)
    tasks = state.link_tasks  # strong references: the loop keeps only weak ones to running tasks

    async def answer(body: bytes, t0: float) -> None:
        state.frames_waiting -= 1  # (a task cancelled before it starts only happens at shutdown)
        status, reply = await _apply_frame(state, body, t0)
        if not ws.closed:
            try:
                await ws.send_bytes(encode_reply(body, status, reply))
            except (ConnectionError, RuntimeError):
                pass  # the previous hop went away: it retries or repairs the route

    try:
        async for msg in ws:
            t0 = time.perf_counter()
            if msg.type == aiohttp.WSMsgType.BINARY:
                state.frames_waiting += 1
                task = asyncio.create_task(answer(msg.data, t0))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif msg.type == aiohttp.WSMsgType.TEXT:
                status, reply = _error_reply(state, ProtocolError("bad_frame", "a link takes binary frames"))
                await ws.send_bytes(encode_reply(b"", status, reply))
    finally:
        state.links_in.discard(ws)
    return ws


async def _reply_link(state: NodeState, ws: web.WebSocketResponse, request: web.Request,
                      sid: uuid.UUID) -> web.WebSocketResponse:
    """Hold ``ws`` as session ``sid``'s reply link until the client closes it (messages from the client are
    ignored), or the session is closed."""
    await ws.prepare(request)
    old = state.reply_links.get(sid)
    state.reply_links[sid] = ws
    if old is not None:
        await old.close()
    state.links_in.add(ws)
    try:
        async for _msg in ws:
            pass
    finally:
        state.links_in.discard(ws)
        if state.reply_links.get(sid) is ws:
            del state.reply_links[sid]
    return ws


async def _send_direct(state: NodeState, frame: Frame, body: bytes, reply: bytes) -> None:
    """The head's reply to ``body`` (a step of ``frame``'s session) on the session's reply link, if it has one;
    a link that fails is dropped (the reply still goes back along the route)."""
    ws = state.reply_links.get(frame.session_id)
    if ws is None or ws.closed:
        return
    try:
        await ws.send_bytes(encode_reply(body, 200, reply))
    except (ConnectionError, RuntimeError):
        state.reply_links.pop(frame.session_id, None)


async def _apply_frame(state: NodeState, body: bytes, t0: float) -> tuple[int, bytes]:
    """Apply one step frame (the body of ``POST /v1/step`` or a link message) received at ``t0``
    (perf_counter s): (HTTP status, JSON reply bytes) — ``{token, logprobs, hops}``, or an error body."""
    try:
        if len(body) > state.max_body + 1024:  # a chunked body (no Content-Length) or a link message
            raise _frame_too_large(state)
        frame = decode_frame(body, state.cfg.n_embd, state.max_step_tokens)
        kind = "decode" if frame.n_tokens == 1 or frame.verify else "prefill"  # a verify step decodes several
        state.bytes_in.labels(kind).inc(len(body))
        if (frame.dtype == "ids") != state.spec.embed:
            want = "token ids (dtype ids)" if state.spec.embed else f"hidden states ({', '.join(WIRE_DTYPES)})"
            raise ProtocolError("bad_dtype", f"layers {state.spec.start}:{state.spec.end} take {want}; "
                                             f"got a {frame.dtype} frame")
        if frame.verify and state.spec.head and frame.n_tokens > state.max_verify_tokens:
            raise ProtocolError("too_many_tokens", f"a verify step (frame flag 4) holds at most "
                                                   f"{state.max_verify_tokens} tokens on this head, got {frame.n_tokens}")
        session = state.store.get(frame.session_id)
        session.stepping += 1  # in a step until its reply is back: never expired meanwhile (next hops may be slow)
        state.active_sessions += session.stepping == 1
        try:
            return await _apply_session_frame(state, session, frame, body, kind, t0)
        finally:
            session.stepping -= 1
            state.active_sessions -= session.stepping == 0
            session.last_used = time.monotonic()
    except Exception as exc:  # noqa: BLE001
        return _error_reply(state, exc)


async def _apply_session_frame(state: NodeState, session: Session, frame: Frame, body: bytes, kind: str,
                               t0: float) -> tuple[int, bytes]:
    """Apply one step of ``session``, in parts: replay or apply the step (_replay, _apply) under the session's
    lock; the head answers (_head_reply) and records its reply (_record) under the lock too; another node
    pushes its output to the next hop (_push) under the lock, then releases it and waits for that hop's reply
    (_relayed) and records it. The session's next step can run here while this one is still downstream: steps
    reach the next hop in order (one link, in push order), and it applies each under its own lock. With the
    head's reply link the client sends the next step as soon as the head has sampled, and no node holds it up
    waiting for the reply of the one before. Raises what the step raises."""
    async with session.lock:
        digest = zlib.crc32(body)
        record = _replay(state, session, frame, digest)
        if record is None:  # the next step
            record = _apply(state, session, frame, digest)
            if isinstance(record, asyncio.Future):
                record = await record
            state.steps.labels(kind).inc()
            state.step_seconds.labels(kind).observe(record.compute_ms / 1e3)
            if state.snapshots is not None:
                state.snapshots.after_step(session, kind == "prefill" and frame.sample)
        elif record.reply is not None:  # a retry of a step answered: the same answer
            if state.spec.head:
                await _send_direct(state, frame, body, record.reply)
            return 200, record.reply
        elif record.relay is not None and not record.relay.done():  # a retry while the step is downstream
            pending = record.relay
            record = None
        # else a retry of a step whose relay failed: its recorded output is relayed again
        if record is not None:
            hop = {"compute_ms": round(record.compute_ms, 3), "bytes_in": len(body), "kv_tokens": session.length}
            if state.spec.head:
                reply = _record(record, _head_reply(record, hop), hop, t0)
                await _send_direct(state, frame, body, reply)
                return 200, reply
            sent = await _push(state, session, frame, record, kind)
            pending = record.relay = asyncio.ensure_future(_relayed(sent, record, hop, t0))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # its waiters may have gone
            if not sent.ordered:  # plain POSTs may overtake each other: keep the session until the reply
                return 200, await asyncio.shield(pending)
    return 200, await asyncio.shield(pending)


def _replay(state: NodeState, session: Session, frame: Frame, digest: int) -> StepRecord | None:
    """The StepRecord of the session's last step when ``frame`` retries it (same step number, same content,
    CRC-32 ``digest`` of the frame): answer it again, never apply it twice. None when ``frame`` is the
    session's next step. StepConflict otherwise: position_mismatch, step_conflict, stale_step or step_gap."""
    record = state.store.replay(session, frame.step, digest, frame.start, frame.n_tokens, frame.rewind)
    if record is not None:
        state.replays.inc()
    return record


def _apply(state: NodeState, session: Session, frame: Frame, digest: int) -> StepRecord | asyncio.Future:
    """Apply the session's next step: its StepRecord when it ran here, or an asyncio.Future of it when it went
    to the worker pool (await it). Raises (or the future does) what SessionStore.apply raises. On a llama.cpp
    node the step goes through the batcher (node/batching.py: run together with other sessions' steps, a prefill
    in pieces), except a speculative verify step (all rows' logits at the head), which runs alone; on a torch
    node every step runs alone."""
    args = (session, frame.step, digest, frame.start, frame.data, frame.token_ids, frame.sample)
    if frame.verify:
        args += (True,)
    elif state.batcher is not None:  # llama.cpp: batched with other sessions' steps, prefills in pieces
        # alone: no other session's step is in flight here, nor read and about to start: a step run inline on the
        # loop would otherwise hold up the steps its batch could have taken along
        return state.batcher.submit(args, alone=state.active_sessions <= 1 and not state.frames_waiting,
                                    more=state.frames_waiting > 0)
    lock = state.inline_lock if frame.n_tokens == 1 else None
    if lock is not None and lock.acquire(blocking=False):
        # A decode step when the shard is idle runs right here on the event loop: it takes a few ms,
        # and the hand-off to a worker thread and back costs ~0.5 ms (about 10 % of a hop's step;
        # bench/bench_llamacpp.py). With the shard busy (a prefill, a snapshot) it queues in the pool,
        # so the loop never waits for another step.
        try:
            return state.store.apply(*args)
        finally:
            lock.release()
    return asyncio.get_running_loop().run_in_executor(state.pool, state.store.apply, *args)


def _head_reply(record: StepRecord, hop: dict) -> dict:
    """The head's reply to a step: ``{token, hops: [hop]}``, with ``logprobs`` / ``token_logprob`` when the
    session asked for them."""
    reply = {"token": record.token, "hops": [hop]}
    if record.tokens is not None:  # a verify step: the token sampled after each of its positions
        reply["tokens"] = record.tokens
    if record.logprobs is not None:
        reply["logprobs"] = record.logprobs
    if record.token_logprob is not None:
        reply["token_logprob"] = record.token_logprob
    return reply


@dataclass
class _Sent:
    """A step pushed to the next hop ``url`` at ``t_push`` (perf_counter s); ``reply``: the future of its
    (status, body); ``ordered``: it went over a link, so later steps of the session reach the hop after it."""

    url: str
    t_push: float
    reply: asyncio.Future
    ordered: bool


async def _push(state: NodeState, session: Session, frame: Frame, record: StepRecord, kind: str) -> _Sent:
    """Send the step's output (in the session's wire dtype, with the route's token ids) to the session's next
    hop over its link, waiting at most ``step_timeout_s`` of the session's ``hop_timeout_s`` (seconds) for the
    reply. ProtocolError naming the hop when it cannot be sent (hop_failed, hop_timeout)."""
    ids = frame.data if frame.dtype == "ids" else frame.token_ids
    out = encode_hidden(frame.session_id, frame.step, frame.start, record.output, session.wire_dtype,
                        ids, frame.flags & (FLAG_NO_SAMPLE | FLAG_VERIFY | FLAG_REWIND))
    state.bytes_out.labels(kind).inc(len(out))
    url = session.next_hop
    t_push = time.perf_counter()
    reply, ordered = await state.links.send(url, out, step_timeout_s(session.hop_timeout_s, frame.n_tokens))
    return _Sent(url, t_push, reply, ordered)


async def _relayed(sent: _Sent, record: StepRecord, hop: dict, t0: float) -> bytes:
    """The reply to a pushed step: the next hop's parsed reply with ``hop`` (this node's timings, ``push_ms``
    added) first in its ``hops``, recorded (_record). ProtocolError naming the hop on any failure: the hop's
    own error passed on, hop_failed or hop_timeout."""
    status, body = await sent.reply
    if status != 200:
        raise reply_error(body, status, sent.url)
    try:
        reply = json.loads(body)
    except ValueError:
        raise ProtocolError("hop_failed", f"next hop {sent.url} answered a step with non-JSON", hop=sent.url) from None
    hop["push_ms"] = round((time.perf_counter() - sent.t_push) * 1e3, 3)
    reply["hops"].insert(0, hop)
    return _record(record, reply, hop, t0)


def _record(record: StepRecord, reply: dict, hop: dict, t0: float) -> bytes:
    """Finish the step: ``hop`` gets ``handle_ms`` (since ``t0``, perf_counter s) and the reply's JSON bytes
    are kept on the step's record (a retry of the step is answered with exactly these). The reply bytes."""
    hop["handle_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    record.reply = json.dumps(reply).encode()
    return record.reply


async def model_info(request: web.Request) -> web.Response:
    """``GET /v1/model``: what model this node serves — ``{name, fingerprint, arch, n_layers, files: [{name, bytes,
    header_bytes}]}`` — so a client without the GGUF (a gateway started with only ``--route``) can fetch its
    headers (``GET /v1/model/header/{i}``) for the vocabulary and chat template."""
    state: NodeState = request.app[NODE]
    model = state.executor.model
    files = [{"name": p.name, "bytes": p.stat().st_size, "header_bytes": n} for p, n in zip(model.paths,
                                                                                           model.header_sizes)]
    return _json({"name": state.model_name, "fingerprint": model.fingerprint, "arch": state.cfg.arch,
                  "n_layers": state.cfg.n_layers, "files": files})


async def model_header(request: web.Request) -> web.Response:
    """``GET /v1/model/header/{i}``: the GGUF header (metadata + tensor table) of the model's file ``i``
    (application/octet-stream, ``header_bytes`` of ``GET /v1/model``); 404 for no such file."""
    state: NodeState = request.app[NODE]
    model = state.executor.model
    try:
        i = int(request.match_info["i"])
        path, size = model.paths[i], model.header_sizes[i]
        if i < 0:
            raise IndexError
    except (ValueError, IndexError):
        return _error(state, ProtocolError("not_found", f"no model file {request.match_info['i']!r}: the model has "
                                                        f"{len(model.paths)} file(s), 0..{len(model.paths) - 1}"))
    with open(path, "rb") as f:
        data = f.read(size)
    return web.Response(body=data, content_type="application/octet-stream")


async def health(request: web.Request) -> web.Response:
    """``GET /health`` → 200 JSON (see NodeState.health)."""
    return _json(request.app[NODE].health())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` → Prometheus text format from this app's own registry."""
    data = generate_latest(request.app[NODE].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _reaper(state: NodeState) -> None:
    """Drop sessions idle past their lease or the TTL, every ``period`` s. A wake-up later than that by more than
    half a period means the loop was stalled: that time is credited to every session (SessionStore.credit_stall)."""
    period = max(0.05, min(state.store.ttl_s / 4, 1.0))  # leases may be a few seconds
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        late, last = now - last - period, now
        if late > period / 2:
            state.store.credit_stall(late)
        if state.store.expire():
            state.readvertise()


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def shard_accounting(state: NodeState) -> dict:
    """``extra.accounting`` of the advertisement: this shard's numbers, from its GGUF header
    (``artifact.accounting``) and its session store; the tracker plans with these alone.

    ``kv_bytes_per_token`` (the executor's: f16 llama.cpp cache, or the torch backend's dtype; 0 for
    recurrent layers), ``state_bytes_per_session``, ``weight_bytes``, ``boundary_bytes_per_token`` (f32
    frames), ``n_embd``; ``free_bytes``: KV/state bytes of the node's budget not reserved by open sessions
    (``(budget - reserved tokens) * kv_bytes_per_token + free slots * state_bytes_per_session``);
    ``free_sessions``: session slots left (None: not limited); ``max_length``: the longest session it opens.
    """
    static = getattr(state, "_accounting", None)
    if static is None:
        from ..artifact.accounting import shard_account
        try:
            acc = shard_account(state.executor.model, state.spec.start, state.spec.end, state.spec.embed,
                                state.spec.head).to_json()
        except (AttributeError, KeyError, ValueError):  # an executor without a GGUF header (a test double)
            acc = {"weight_bytes": 0, "state_bytes_per_session": 0, "n_embd": state.cfg.n_embd,
                   "boundary_bytes_per_token": 0 if state.spec.head else 4 * state.cfg.n_embd}
        static = state._accounting = {k: acc[k] for k in ("weight_bytes", "state_bytes_per_session",
                                                          "boundary_bytes_per_token", "n_embd")}
    store = state.store
    per_token = store.kv_bytes_per_token()
    slots = getattr(state.executor, "n_seq_max", None)
    free_sessions = None if slots is None else max(slots - len(store.sessions), 0)
    free_state = (free_sessions if free_sessions is not None else 1) * static["state_bytes_per_session"]
    return {**static, "kv_bytes_per_token": per_token,
            "free_bytes": max(store.budget_tokens - store.reserved_tokens, 0) * per_token + free_state,
            "free_sessions": free_sessions,
            "max_length": state.max_session_tokens}


def advertisement(state: NodeState) -> dict:
    """This node's shard advertisement for the tracker (free KV in tokens, mean decode compute in ms, and
    the shard's accounting in bytes: ``shard_accounting``)."""
    reg = state.registry
    h = state.health()
    n = reg.get_sample_value("ggufswarm_node_step_seconds_count", {"kind": "decode"}) or 0.0
    total = reg.get_sample_value("ggufswarm_node_step_seconds_sum", {"kind": "decode"}) or 0.0
    return {"node_id": state.node_id, "url": state.url, "model": state.config.swarm_name or state.config.model,
            "layers": [state.spec.start, state.spec.end], "embed": state.spec.embed, "head": state.spec.head,
            "state": "ready", "free_kv_tokens": state.store.budget_tokens - state.store.reserved_tokens,
            "decode_ms": round(1e3 * total / n, 3) if n else 0.0,
            # what a client needs to use this node in a route (client.remote.Hop), so it need not ask /health
            "extra": {"hop": {k: h[k] for k in ("n_embd", "n_layers", "max_length", "max_step_tokens",
                                                "model_fingerprint", "model_name", "max_verify_tokens")}
                      | {"cache": bool(h["cache"])},
                      "accounting": shard_accounting(state)}}


READVERTISE_S = 0.2  # after a change of free KV, at most this long (s) before the tracker hears of it; batches a burst


async def _heartbeats(state: NodeState) -> None:
    """Advertise to the tracker once listening, then every ``heartbeat_s`` seconds (at most a third of
    the tracker's TTL, which it returns), and within ``READVERTISE_S`` of sessions opening, closing or expiring
    (``NodeState.readvertise``): the tracker plans from the free KV advertised. Tracker errors are reported once,
    never fatal."""
    url = state.config.tracker.rstrip("/") + "/nodes/heartbeat"
    interval, warned = state.config.heartbeat_s, False
    state.capacity_changed = changed = asyncio.Event()
    while not state.url:  # advertise as soon as we listen
        await asyncio.sleep(0.05)
    while True:
        try:
            async with state.client.post(url, json=advertisement(state), timeout=aiohttp.ClientTimeout(total=5)) as r:
                ok = r.status == 200
                body = await r.json(content_type=None) if ok else None
                reason = "" if ok else (await r.text())[:200]
            if ok and isinstance(body, dict) and body.get("ttl_s"):
                interval = min(state.config.heartbeat_s, float(body["ttl_s"]) / 3)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            ok, reason = False, str(exc) or type(exc).__name__
        if not ok and not warned:
            print(f"ggufswarm node: tracker heartbeat failed ({reason}); still serving", file=sys.stderr, flush=True)
        warned = not ok
        try:
            await asyncio.wait_for(changed.wait(), interval)
            await asyncio.sleep(READVERTISE_S)  # the rest of a burst of opens / closes goes in the same beat
        except asyncio.TimeoutError:
            pass
        changed.clear()


async def _deregister(state: NodeState) -> None:
    try:
        async with state.client.delete(f"{state.config.tracker.rstrip('/')}/nodes/{state.node_id}",
                                       timeout=aiohttp.ClientTimeout(total=3)):
            pass
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass


def load_executor(config: NodeConfig):
    """Load the shard named by ``config`` on its backend (reads only its tensors).

    llama.cpp: ``max_sessions`` sequences of ``ctx_size`` KV cells each (capped by the model's
    context and by ``kv_budget_tokens`` / ``kv_budget_mb``), its derived shard GGUF written under
    ``data_dir/shards``. Raises GGUFError / ValueError (an unsupported architecture included).
    """
    file = GGUFModelFile(resolve_model(config.model))
    model_cfg = model_config(file, config.backend)
    spec = ShardSpec.parse(config.layers, model_cfg.n_layers, config.embed, config.head)
    for flag, value in (("--max-sessions", config.max_sessions), ("--ctx-size", config.ctx_size)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if config.state_checkpoints < 0:
        raise ValueError(f"--state-checkpoints must be at least 0, got {config.state_checkpoints}")
    per_session = min(config.ctx_size, model_cfg.max_length, max(config.kv_budget_tokens // config.max_sessions, 1))
    if config.kv_budget_mb is not None and config.backend == "llama.cpp":  # the context is allocated whole
        from ..runtime.llamacpp.backend import kv_bytes_per_token
        per_token = max(kv_bytes_per_token(file, spec), 1)
        per_session = max(1, min(per_session, int(config.kv_budget_mb * 2 ** 20) // per_token // config.max_sessions))
    shard = load_shard(file, spec, config.backend, config=model_cfg, dtype=config.dtype, threads=config.threads,
                       max_length=per_session, max_sessions=config.max_sessions,
                       cache_dir=Path(config.data_dir) / "shards", state_checkpoints=config.state_checkpoints,
                       kv_unified=config.batch_group > EXACT_BATCH_GROUP)  # throughput mode: any sessions batch
    return shard


def make_app(config: NodeConfig, executor=None) -> web.Application:
    """The node's aiohttp app; loads the shard unless ``executor`` is given. Raises as load_executor."""
    state = NodeState(config, executor or load_executor(config))
    # bodies: one frame of max_step_tokens f32 rows, or a JSON restore of up to 128K token ids
    app = web.Application(client_max_size=max(state.max_body, 2 * 2 ** 20) + 1024,
                          middlewares=[token_middleware(config.token),
                                       json_errors_middleware(lambda _req, err: state.errors.labels(err.code).inc())])
    app[NODE] = state
    app.router.add_post("/v1/sessions", open_session)
    app.router.add_delete("/v1/sessions/{sid}", close_session)
    app.router.add_post("/v1/sessions/{sid}/truncate", truncate_session)
    app.router.add_post("/v1/sessions/{sid}/restore", restore_session)
    app.router.add_post("/v1/sessions/{sid}/renew", renew_session)
    app.router.add_post("/v1/step", step)
    app.router.add_get("/v1/link", link)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/model", model_info)
    app.router.add_get("/v1/model/header/{i}", model_header)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(app):
        state.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             headers=auth_headers(config.token))
        tasks = [asyncio.create_task(_reaper(state))]
        if config.exit_with_parent:
            tasks.append(asyncio.create_task(_watch_parent(os.getppid())))
        if config.tracker:
            tasks.append(asyncio.create_task(_heartbeats(state)))
        yield
        for t in tasks:
            t.cancel()
        if state.snapshots is not None:
            await state.snapshots.drain(5.0)
            state.snapshots.close()
        if config.tracker:
            await _deregister(state)
        await state.links.close()
        await state.client.close()
        state.pool.shutdown(wait=False, cancel_futures=True)

    async def close_links_in(app):  # else the server waits for previous hops to hang up (shutdown_timeout)
        for ws in list(state.links_in):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"node shutting down")

    app.on_shutdown.append(close_links_in)
    app.cleanup_ctx.append(lifecycle)
    return app


def wait_for_model(tracker: str, name: str | None, every_s: float = 2.0, parent: int | None = None,
                   who: str = "node", *, token: str | None = None) -> None:
    """Block until ``tracker`` answers and has ``name`` published (None: until it answers), saying once (one
    line, as ``ggufswarm {who}``) what it waits for: start order does not matter. ``token``: the swarm token.
    Raises TrackerError for any other refusal (a wrong token, say), SystemExit when ``parent`` (a pid) is gone
    (``--exit-with-parent``)."""
    from ..swarm.publish import TrackerError, tracker_call

    said = None
    while True:
        if parent is not None and os.getppid() != parent:
            raise SystemExit(1)
        try:
            tracker_call(f"{tracker.rstrip('/')}/" + (f"manifests/{name}" if name else "models"), timeout=10,
                         token=token)
            if said:
                print(f"ggufswarm {who}: {'the tracker answers' if name is None else name + ' is published'}; "
                      f"going on", file=sys.stderr, flush=True)
            return
        except TrackerError as exc:
            if exc.status not in (None, 404):
                raise
            why = (f"waiting for the tracker {tracker} to answer" if exc.status is None else
                   f"waiting for model {name!r} to be published on {tracker} (ggufswarm publish --name {name})")
            if why != said:
                print(f"ggufswarm {who}: {why}; retrying every {every_s:g} s (Ctrl-C stops)", file=sys.stderr,
                      flush=True)
                said = why
        time.sleep(every_s)


def run_node(config: NodeConfig) -> int:
    """``ggufswarm node``: load the shard, serve it, print one ready line to stdout; exit 0 on SIGINT/SIGTERM.

    With ``config.tracker``, first fetches the shard's bytes from the swarm (``layers`` may be
    ``"auto"``), seeds them while serving, and advertises to the tracker until shut down.
    """
    fetched = None
    if config.port:  # a port in use fails now, not after the shard's download
        import socket
        with socket.socket() as probe:
            # as the server will bind (asyncio's reuse_address on Unix): a port held only by TIME-WAIT connections
            # of a node killed a moment ago is free to listen on again
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, config.port))
            except OSError as exc:
                raise OSError(f"cannot listen on {config.host}:{config.port}: {exc.strerror}") from None
    if config.tracker:
        from ..swarm.shard_fetch import fetch_shard
        name = config.model or "gemma-3-270m-q4_k_m"
        wait_for_model(config.tracker, name, parent=os.getppid() if config.exit_with_parent else None,
                       token=config.token)
        fetched = fetch_shard(config.tracker, name, config.layers, config.embed, config.head, Path(config.data_dir),
                              budget_bytes=int(config.memory_budget_mb * 2**20), timeout=config.fetch_timeout_s,
                              stall_s=config.fetch_stall_s, token=config.token)
        got = (f"{fetched.stats.bytes_downloaded} bytes in {fetched.stats.seconds:.1f} s"
               if fetched.stats.bytes_downloaded else "already on disk, checked")
        print(f"ggufswarm node: fetched layers {fetched.spec.start}:{fetched.spec.end} of {name}: {got}",
              file=sys.stderr, flush=True)
        config = replace(config, layers=f"{fetched.spec.start}:{fetched.spec.end}", embed=fetched.spec.embed,
                         head=fetched.spec.head, model=str(fetched.path), swarm_name=name)
    app = make_app(config)
    state: NodeState = app[NODE]
    spec = state.spec
    if spec.end == state.cfg.n_layers and not spec.head:
        print(f"ggufswarm node: WARNING: layers {spec.start}:{spec.end} end at the model's last layer without --head: "
              f"no route can end here (add --head)", file=sys.stderr, flush=True)
    if spec.start == 0 and not spec.embed:
        print(f"ggufswarm node: WARNING: layers {spec.start}:{spec.end} start at layer 0 without --embed: no route "
              f"can start here (add --embed)", file=sys.stderr, flush=True)

    def ready(url: str) -> None:
        state.url = url
        stages = "".join([" +embed" if spec.embed else "", " +head" if spec.head else ""])
        print(f"ggufswarm node ready: {url} layers {spec.start}:{spec.end}{stages} "
              f"kv_budget {state.store.budget_tokens} tokens", flush=True)

    try:
        run_server(app, config.host, config.port, ready)
    finally:
        if fetched is not None:
            fetched.swarm.close()
    return 0
