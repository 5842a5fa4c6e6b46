"""What a node's handlers share: its settings (``NodeConfig``), its shard, session store, links and metrics
(``NodeState``, which builds the step path's ``StepPath``: node/step_path.py), and the helpers every handler answers
with (a JSON body, a counted error reply)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..artifact.default_model import model_name
from ..directory.trackers import TrackerClient
from ..net.http import JSON, as_protocol_error
from ..net.identity import NodeIdentity
from ..net.link import LinkPool
from ..net.reach import Proven
from ..protocol import PROTOCOL_VERSION, ProtocolError
from ..runtime.backends import DEFAULT_BACKEND, ShardBackend
from ..runtime.sessions import SessionStore
from .step_path import StepPath

NODE = web.AppKey("node", object)  # the app's NodeState
# --batching: "exact" (default) keeps every session's result bitwise its run alone (one llama.cpp KV stream per
# session; how many share a ubatch: runtime/llamacpp/batch.py); "throughput": one unified KV stream, so that any of
# its sessions share a ubatch, not bitwise
BATCHING_MODES = ("exact", "throughput")
BYTES_PER_MIB = 2**20
DEFAULT_CTX_SIZE = 8192  # --ctx-size (tokens) where the KV cache is allocated as sized (node/memory.py)


@dataclass
class NodeConfig:
    """Settings of one node. ``layers``: ``"START:END"`` (half-open). Units: seconds, tokens, MiB."""

    layers: str
    embed: bool = False
    head: bool = False
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    dtype: str = "float32"  # torch backend's compute dtype
    backend: str = DEFAULT_BACKEND  # "llama.cpp" or "torch" (runtime.backends)
    threads: int | None = None  # llama.cpp decode/batch threads (None: all cores)
    gpu: str = "none"  # llama.cpp: auto | none | a device name (runtime/llamacpp/devices.py); the CLI's default: auto
    gpu_blocks: int | None = None  # llama.cpp with a GPU: the range's last N blocks there (None: as many as fit)
    ctx_size: int | None = None  # the longest session (tokens; None: node.memory.session_cells' default)
    max_sessions: int = 4  # llama.cpp: sessions at once (sequence ids of the context)
    batching: str = "exact"  # llama.cpp: BATCHING_MODES
    batch_group: int | None = None  # llama.cpp: most sessions per shared ubatch (None: the mode's default)
    kv_budget_tokens: int = 262144
    kv_budget_mb: float | None = None
    session_ttl_s: float = 300.0
    hop_timeout_s: float = 30.0
    max_step_tokens: int = 4096
    workers: int = 4
    exit_with_parent: bool = False
    tracker: str | None = None  # with a tracker: ``model`` is a published name, fetched from the swarm
    data_dir: str = "ggufswarm-data"  # where swarm-fetched shards are stored (sparse files)
    heartbeat_s: float = 5.0
    swarm_name: str | None = None  # the published name advertised to the tracker (set after a fetch)
    memory_budget_mb: float | None = None  # layers "auto": most MiB of weights to take (None: node.app.layers_budget)
    fetch_timeout_s: float = 1800.0  # with a tracker: the shard fetch fails after this long in all
    fetch_stall_s: float = 60.0  # with a tracker: warn and retry when the fetch gets no piece this long
    token: str | None = None  # swarm token: required on every endpoint, sent to tracker, hops, cache
    cache: str | None = None  # snapshot cache server URL (``ggufswarm cache``)
    snapshot_every: int = 32  # with a cache: snapshot each session every N tokens after its prefill
    state_checkpoints: int = 4  # llama.cpp exact-state shards: session states kept to truncate to
    # -- across NATs and without a tracker (issue 25; net/, node/reach.py) --
    dht: tuple[str, ...] | None = None  # BitTorrent DHT bootstrap contacts; None: no DHT, (): DHT with no contact
    model_id: str | None = None  # the model's identity (manifest digest, from a join link): its DHT key
    reach: str = "direct"  # "direct": advertise host:port as it is; "auto": dial-back check, port mapping, relay
    public_host: str | None = None  # the address others dial (default: --host, or what a dial-back observed)
    relay: bool = False  # also relay for nodes that cannot be dialled (net/relay.py), and answer dial-backs
    more_trackers: tuple[str, ...] = ()  # further trackers of the same swarm (a join link's): heartbeats go to each
    relays: tuple[str, ...] = ()  # relays (node or tracker URLs) this node may attach to when it cannot be dialled
    torrent_port: int = 0  # the BitTorrent/DHT port (TCP + UDP; 0: any) — the DHT contact a join link gives
    test_lie: str | None = None  # testing only: this node lies (node/lies.py: noise, noise-every:N, weights:PATH)


def rss_bytes() -> int | None:
    """This process's resident memory (bytes; ``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


async def _unchecked(url: str, what: str) -> None:
    """The next-hop check of a NodeState built without one: every node refused."""
    raise ProtocolError("next_hop_unknown", f"{what} {url}: this node has no next-hop check; refused")


class NodeState:
    """Everything a node's handlers share: the shard (a ``runtime.backends.ShardBackend``), its session store,
    metrics, the tracker client, and ``path``, what its step path uses (a ``StepPath``: the links to next hops,
    reply links, limits, step metrics). ``check_hop(state, url, what)``: the check that frames may go to node
    ``url`` (node.advertise.check_registered), which ``path.check_hop`` runs for this node (None: refuse all).

    Raises ValueError for a ``batch_group`` below 1 on a shard that batches, or above what stays bitwise in the
    exact mode."""

    def __init__(
        self,
        config: NodeConfig,
        executor: ShardBackend,
        check_hop: Callable[[NodeState, str, str], Awaitable[None]] | None = None,
    ):
        self.config = config
        self.executor = executor
        # the node's ed25519 key pair (net/identity.py); its public key is its id in the swarm
        self.identity = NodeIdentity.claim(config.data_dir)
        self.node_id = self.identity.key_id
        self.url = ""
        self.spec = executor.spec
        self.cfg = executor.cfg
        budget = config.kv_budget_tokens
        if executor.n_ctx_seq is not None and executor.n_seq_max is not None:
            budget = min(budget, executor.n_ctx_seq * executor.n_seq_max)  # cells allocated up front: the budget
        self.store = SessionStore(executor, budget, config.session_ttl_s)
        if config.kv_budget_mb is not None:
            per_token = max(self.store.kv_bytes_per_token(), 1)
            self.store.budget_tokens = min(budget, int(config.kv_budget_mb * BYTES_PER_MIB) // per_token)
        # a GPU's KV cache sized to its sessions (llama.cpp kv_size): no more than its free memory holds at start
        device_tokens = getattr(executor, "device_kv_tokens", lambda: None)()
        if device_tokens is not None:
            self.store.budget_tokens = min(self.store.budget_tokens, max(device_tokens, 1))
        # The longest session one open may reserve: one sequence's cells where the backend has them (llama.cpp:
        # node.memory.session_cells: up to the whole budget where its KV is paged, else at most 1/--max-sessions of
        # it, so that no single request takes all the KV allocated), else that last rule over the token budget.
        # Never more than the budget (a session that could never open is then a 400 at the gateway, not a 503 here)
        # nor than --ctx-size (llama.cpp rounds a stream's cells up to a multiple of 256).
        cap = executor.n_ctx_seq
        if cap is None:
            cap = min(config.ctx_size or DEFAULT_CTX_SIZE, max(self.store.budget_tokens // config.max_sessions, 1))
        cap = min(cap, config.ctx_size or cap, self.store.budget_tokens)
        self.store.max_session_tokens = self.max_session_tokens = min(self.cfg.max_length, cap)
        if executor.n_seq_max is not None:  # nor more than its sequences can reserve (--ctx-size below 256 cells)
            self.store.budget_tokens = min(self.store.budget_tokens, executor.n_seq_max * self.max_session_tokens)
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="shard")
        # steps of different sessions arriving while the shard is busy run together (node/batching.py)
        # a shard whose steps serialize on one lock (llama.cpp: one context) runs idle decode steps inline (steps.py)
        inline_lock, batcher = executor.step_lock, None
        if executor.supports_batch and inline_lock is not None:
            from .batching import StepBatcher

            group = config.batch_group
            if group is not None and group < 1:
                raise ValueError(f"--batch-group must be at least 1, got {group}")
            if group is not None and config.batching == "exact" and group > executor.batch_group:
                raise ValueError(
                    f"--batch-group {group}: at most {executor.batch_group} sessions per ubatch stay bitwise their "
                    "runs alone with this llama.cpp (batch-invariant decode needs llama.cpp patch 0005, which "
                    "`make setup` builds); use --batching throughput for more, not bitwise"
                )
            if group is not None:
                executor.batch_group = group
            batcher = StepBatcher(self.store, self.pool)
        self.banned: str | None = None  # why it stopped: a tracker refused its key as banned (advertise.heartbeats)
        self.refused: str | None = None  # why it stopped: a tracker refused its advertisement as malformed (ibid.)
        self.capacity_changed: asyncio.Event | None = None  # set by readvertise(); the heartbeat loop's
        self.client: aiohttp.ClientSession | None = None
        # the swarm's trackers (the first one also fetched the shard); heartbeats go to all of them
        self.trackers = [TrackerClient(u, config.token) for u in (config.tracker, *config.more_trackers) if u]
        self.tracker = self.trackers[0] if self.trackers else None
        self.peers: dict[str, str] = {}  # node URL -> key the tracker listed for this model (next_hop check), and when
        self.peers_at = 0.0
        self.proven = Proven()  # next hops and peers that proved to hold their keys: where the token may go
        self.accounting: dict | None = None  # the static part of the advertised accounting (advertise.py)
        self.numerics: dict | None = None  # what decides this shard's output bits (node/numerics.py), once computed
        self.reach = None  # how others reach this node (node/reach.py Reach), once established
        self.swarm = None  # the libtorrent session seeding this shard (swarm.torrent.Swarm), when fetched
        self.discovery = None  # its DHT (net.dht.Discovery), with config.dht
        self.directory = None  # the trackers and the DHT (directory.lookup.Directory), with either
        self.manifest_answer: dict | None = None  # {"manifest", "torrent_hex"} this shard was fetched with
        self.relay_server = None  # with config.relay (net.relay.RelayServer)
        self.relay_client = None  # when this node is reached through a relay (net.relay.RelayClient)
        self.heard: dict[str, float] = {}  # peers' URLs that said hello -> until when they are passed on (monotonic)
        self.port_mapper = None  # with --reach auto: UPnP / NAT-PMP through its swarm session (net.portmap)
        self.snapshots = None
        if config.cache:
            from .snapshots import SnapshotLink, shard_of

            self.snapshots = SnapshotLink(
                config.cache, shard_of(executor), config.snapshot_every, lambda: self.client, executor, self.identity
            )
        # most tokens in one step: --max-step-tokens, at most what the backend takes in one call (llama.cpp: n_batch)
        max_step = min(config.max_step_tokens, executor.n_batch or config.max_step_tokens)
        # the head's most tokens in a speculative verify step (FLAG_VERIFY: every row's logits); None elsewhere
        max_verify = min(executor.max_outputs or max_step, max_step) if self.spec.head else None
        # what the step path uses (node/steps.py, node/ring.py); the links to next hops are net/link.py's
        self.path = StepPath(
            spec=self.spec,
            n_embd_in=self.cfg.width_at(self.spec.start),
            n_embd_out=self.cfg.width_at(self.spec.end),
            store=self.store,
            identity=self.identity,
            pool=self.pool,
            links=LinkPool(lambda: self.client),
            max_step_tokens=max_step,
            max_verify_tokens=max_verify,
            error_reply=self.error_reply,
            check_hop=_unchecked if check_hop is None else partial(check_hop, self),
            inline_lock=inline_lock,
            batcher=batcher,
            snapshots=self.snapshots,
            test_lie=config.test_lie,
        )
        self._register_metrics()

    def _register_metrics(self) -> None:
        """The node's Prometheus registry (``GET /metrics``): gauges read from the store, step counters."""
        reg = self.registry = CollectorRegistry()
        store = self.store
        Gauge("ggufswarm_node_sessions_open", "Route sessions open on this node", registry=reg).set_function(
            lambda: len(store.sessions)
        )
        Gauge("ggufswarm_node_kv_tokens_held", "Tokens held in KV caches (all sessions)", registry=reg).set_function(
            lambda: store.held_tokens
        )
        Gauge(
            "ggufswarm_node_kv_tokens_reserved", "Tokens reserved by open sessions (sum of max_length)", registry=reg
        ).set_function(lambda: store.reserved_tokens)
        Gauge("ggufswarm_node_kv_budget_tokens", "KV budget of this node in tokens", registry=reg).set_function(
            lambda: store.budget_tokens
        )
        self.errors = Counter("ggufswarm_node_errors", "Requests answered with an error", ["code"], registry=None)
        self.evictions = Counter(
            "ggufswarm_node_sessions_evicted",
            "Sessions evicted because the machine's memory no longer held them",
            registry=None,
        )
        before, after = self.path.metrics.collectors()  # the step path's (node/step_path.py), in the order as ever
        for metric in (*before, self.errors, self.evictions, *after):
            reg.register(metric)

    def readvertise(self) -> None:
        """Sessions opened, closed or expired: have the heartbeat loop send the new free KV to the tracker now, not
        at its next beat (a swarm just freed by a burst of requests was refused as full for up to a beat)."""
        if self.capacity_changed is not None:
            self.capacity_changed.set()

    def totals(self) -> dict:
        """Plain counters for /health (read from the Prometheus registry, so a test need not parse its text)."""

        def value(name: str, kind: str | None = None) -> int:
            return int(self.registry.get_sample_value(name, {"kind": kind} if kind else {}) or 0)

        out = {
            "replays": value("ggufswarm_node_step_replays_total"),
            "errors": int(
                sum(
                    m.value
                    for f in self.registry.collect()
                    if f.name == "ggufswarm_node_errors"
                    for m in f.samples
                    if m.name.endswith("_total")
                )
            ),
        }
        for kind in ("decode", "prefill"):
            out[kind + "_steps"] = value("ggufswarm_node_steps_total", kind)
            out["bytes_in_" + kind] = value("ggufswarm_node_payload_bytes_in_total", kind)
            out["bytes_out_" + kind] = value("ggufswarm_node_payload_bytes_out_total", kind)
        out["steps"] = out["decode_steps"] + out["prefill_steps"]
        return out

    def decode_ms(self) -> float:
        """Mean compute time of a decode step on this shard (ms), 0.0 before the first."""
        n = self.registry.get_sample_value("ggufswarm_node_step_seconds_count", {"kind": "decode"}) or 0.0
        total = self.registry.get_sample_value("ggufswarm_node_step_seconds_sum", {"kind": "decode"}) or 0.0
        return 1e3 * total / n if n else 0.0

    @property
    def model_name(self) -> str:
        """The model's name: the published name with a tracker, else the alias it was started with (smollm2) or the
        GGUF file name without its extension (artifact.default_model.model_name)."""
        return self.config.swarm_name or model_name(self.config.model, self.executor.model.path)

    def placement(self) -> dict | None:
        """Where a llama.cpp shard's blocks run, with its GPU's memory now (runtime/llamacpp/devices.py); None on
        the torch backend."""
        if getattr(self.executor, "placement", None) is None:
            return None
        from ..runtime.llamacpp.devices import placement_now

        return placement_now(self.executor)

    def health(self) -> dict:
        """The ``/health`` body: shard, model shape, limits and counters."""
        s, path = self.store, self.path
        return {
            "status": "ok",
            "protocol": PROTOCOL_VERSION,
            "node_id": self.node_id,
            "model": self.executor.model.path.name,
            "model_name": self.model_name,
            "model_fingerprint": self.executor.model.fingerprint,
            "arch": self.cfg.arch,
            "n_layers": self.cfg.n_layers,
            "n_embd": self.cfg.n_embd,
            "n_vocab": self.cfg.n_vocab,
            "backend": self.executor.backend,
            # llama.cpp: where the blocks run and the buffers llama.cpp allocated on each device
            "placement": self.placement(),
            "max_length": self.max_session_tokens,
            "layers": [self.spec.start, self.spec.end],
            "embed": self.spec.embed,
            "head": self.spec.head,
            "max_step_tokens": self.path.max_step_tokens,
            "hop_timeout_s": self.config.hop_timeout_s,
            "max_verify_tokens": self.path.max_verify_tokens,
            "session_ttl_s": s.ttl_s,
            "sessions": len(s.sessions),
            "kv_budget_tokens": s.budget_tokens,
            "kv_tokens_reserved": s.reserved_tokens,
            "kv_tokens_held": s.held_tokens,
            "kv_bytes_per_token": s.kv_bytes_per_token(),
            "rss_bytes": rss_bytes(),  # the node process's resident memory (docs/memory.md)
            **self.totals(),
            "cache": self.config.cache,
            "snapshots": self.snapshots.counters if self.snapshots else None,
            "links": {"in": len(path.links_in), "replies": len(path.reply_links), **path.links.counts()},
            "batching": None
            if path.batcher is None
            else {
                "mode": self.config.batching,
                "batch_group": self.executor.batch_group,
                **path.batcher.counters(),
            },
            "reach": self.reach.to_json() if self.reach is not None else {"path": "direct"},
            "relay": self.relay_server.stats() if self.relay_server is not None else None,
        }

    def error_reply(self, exc: BaseException) -> tuple[int, bytes]:
        """(HTTP status, JSON error body) answering ``exc`` on a link (net.http.as_protocol_error, the mapping
        the HTTP middleware uses too), counted in the node's error metric."""
        err = as_protocol_error(exc)
        self.count_error(err)
        return err.status, err.body()

    def count_error(self, err: ProtocolError) -> None:
        """Count one error answer (the ``ggufswarm_node_errors`` metric, by code)."""
        self.errors.labels(err.code).inc()


def json_response(obj, status: int = 200) -> web.Response:
    """``obj`` as a JSON answer with HTTP ``status``."""
    return web.Response(body=json.dumps(obj).encode(), status=status, content_type=JSON)


def parse_session_id(text) -> uuid.UUID:
    """``text`` as a session UUID; ProtocolError bad_request otherwise."""
    try:
        return uuid.UUID(str(text))
    except ValueError:
        raise ProtocolError("bad_request", f"session_id must be a UUID, got {text!r}") from None


__all__ = ["BATCHING_MODES", "NODE", "NodeConfig", "NodeState", "json_response", "parse_session_id"]
