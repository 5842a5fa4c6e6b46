"""What a node's per-token step path (node/steps.py, node/ring.py) works with, and nothing more of the node:
``StepPath`` holds the shard's limits, its session store, the links to next hops and from previous hops, the
sessions' reply links and ring grants, the counts of steps in flight and ``StepMetrics``, the step metrics with
their labelled series looked up once. ``NodeState`` builds one (``state.path``); the handlers take it from the app
(``STEP_PATH``). The path, function by function: docs/design.md, "The per-token path, function by function"."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import Counter, Histogram

from ..net.identity import NodeIdentity
from ..net.link import LinkPool
from ..protocol.frame import HEADER_SIZE
from ..runtime.sessions import SessionStore
from ..runtime.spec import ShardSpec

if TYPE_CHECKING:
    from .batching import StepBatcher
    from .ring import Grant
    from .snapshots import SnapshotLink

STEP_KINDS = ("prefill", "decode")  # the ``kind`` label of the step metrics
MESSAGE_KINDS = ("frame", "reply", "direct")  # the ``kind`` label of ggufswarm_node_link_messages_sent
# frame body bytes per token beyond its f32 hidden state row: the token-id trailer (int32)
TOKEN_ID_BYTES = 4
F32_BYTES = 4
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Series(dict):
    """A labelled metric's children by label value (``series[value]`` is ``metric.labels(value)``), each made once,
    on first use, and kept: the hot path looks a child up instead of calling ``labels`` per message. ``values``:
    those made now, so that /metrics lists their series (at 0) before the first count."""

    def __init__(self, metric: Counter | Histogram, values: Iterable[str] = ()):
        super().__init__()
        self.metric = metric
        for value in values:
            self[value] = metric.labels(value)

    def __missing__(self, value: str):
        child = self[value] = self.metric.labels(value)
        return child


class StepMetrics:
    """The step path's Prometheus metrics, made unregistered (``NodeState`` registers them in /metrics' order,
    ``collectors``). By ``kind`` (STEP_KINDS): ``steps`` (count), ``step_seconds`` (compute time, s),
    ``busy_seconds`` (the shard's compute time, a shared decode counted once, s), ``bytes_in`` / ``bytes_out``
    (frame bytes); ``replays`` (retries answered without re-applying); ``messages_sent`` by kind (MESSAGE_KINDS);
    ``ring_steps`` by result (ok, closed, failed). Each labelled one is a ``Series``."""

    def __init__(self):
        def counter(name: str, doc: str, labels: Iterable[str] = ("kind",)) -> Counter:
            return Counter(name, doc, list(labels), registry=None)

        self.steps = Series(counter("ggufswarm_node_steps", "Steps applied"), STEP_KINDS)
        self.step_seconds = Series(
            Histogram(
                "ggufswarm_node_step_seconds",
                "Step compute time (this shard only)",
                ["kind"],
                registry=None,
                buckets=STEP_SECONDS_BUCKETS,
            ),
            STEP_KINDS,
        )
        # the shard's busy time: a shared decode of several sessions counted once (per-token time of this stage
        # = busy / steps; a route's pipeline bound is the slowest stage's)
        self.busy_seconds = Series(
            counter("ggufswarm_node_busy_seconds", "Shard compute time, a shared decode counted once"), STEP_KINDS
        )
        self.bytes_in = Series(
            counter("ggufswarm_node_payload_bytes_in", "Frame bytes received (header + payload)"), STEP_KINDS
        )
        self.bytes_out = Series(
            counter("ggufswarm_node_payload_bytes_out", "Frame bytes pushed to the next hop"), STEP_KINDS
        )
        self.replays = counter("ggufswarm_node_step_replays", "Retried steps answered without re-applying", ())
        self.ring_steps = Series(
            counter(
                "ggufswarm_node_ring_steps",
                "Steps this head sent to its route's first node itself (ring decode), by how they ended",
                ["result"],
            )
        )
        self.messages_sent = Series(
            counter(
                "ggufswarm_node_link_messages_sent",
                "Messages this node sent on WebSocket links: step frames to next hops (frame), replies to the frames "
                "it got (reply), and on sessions' reply links (direct: the head's own replies, the route's it passes "
                "on)",
            ),
            MESSAGE_KINDS,
        )

    def collectors(self) -> tuple[tuple, tuple]:
        """(the metrics /metrics lists before the node's error and eviction counters, those it lists after)."""
        before = (self.steps, self.step_seconds, self.busy_seconds, self.bytes_in, self.bytes_out)
        return (*(s.metric for s in before), self.replays), (self.ring_steps.metric, self.messages_sent.metric)


@dataclass(eq=False)
class StepPath:
    """What the step path uses of its node. The shard: ``spec``, ``n_embd_in`` / ``n_embd_out`` (values per token of
    the hidden states it takes and sends: ``width_at`` its first block and past its last), ``store`` (its sessions),
    ``identity`` (signs step commitments), ``pool`` (worker threads), ``inline_lock`` (the shard's step lock: an idle
    decode step runs on the loop; None: never inline), ``batcher`` (steps of several sessions run together; None:
    each alone), ``snapshots`` (the cache link; None: no cache). Limits (tokens): ``max_step_tokens``,
    ``max_verify_tokens`` (the head's, else None); ``max_body`` (bytes: a frame of max_step_tokens f32 rows).
    ``links``: to next hops; ``links_in``: from previous hops and clients' reply links; ``link_tasks``: frames being
    applied; ``reply_links`` / ``rings``: each session's reply link and ring grant (head). ``active_sessions``:
    sessions with a step in flight; ``frames_waiting``: link frames read, not yet started. ``error_reply(exc)``: the
    (HTTP status, JSON body) answering ``exc``, counted; ``check_hop(url, what)``: raises ProtocolError unless
    frames may go to node ``url`` (a ring's first node). ``test_lie``: testing only (node/lies.py)."""

    spec: ShardSpec
    n_embd_in: int
    n_embd_out: int
    store: SessionStore
    identity: NodeIdentity
    pool: ThreadPoolExecutor
    links: LinkPool
    max_step_tokens: int
    max_verify_tokens: int | None
    error_reply: Callable[[BaseException], tuple[int, bytes]]
    check_hop: Callable[[str, str], Awaitable[None]]
    metrics: StepMetrics = field(default_factory=StepMetrics)
    inline_lock: threading.RLock | None = None
    batcher: StepBatcher | None = None
    snapshots: SnapshotLink | None = None
    test_lie: str | None = None
    links_in: set[web.WebSocketResponse] = field(default_factory=set)
    link_tasks: set[asyncio.Task] = field(default_factory=set)  # strong references: the loop keeps only weak ones
    reply_links: dict[uuid.UUID, web.WebSocketResponse] = field(default_factory=dict)
    rings: dict[uuid.UUID, Grant] = field(default_factory=dict)
    active_sessions: int = 0
    # link messages read but not yet started: the steps of several sessions that arrived while the shard computed
    # (one loop iteration reads them all, their tasks then start one after another; see steps._apply)
    frames_waiting: int = 0
    max_body: int = field(init=False)

    def __post_init__(self):
        self.max_body = HEADER_SIZE + self.max_step_tokens * (self.n_embd_in * F32_BYTES + TOKEN_ID_BYTES)


STEP_PATH = web.AppKey("step_path", StepPath)  # the app's StepPath (its NodeState's ``path``)

__all__ = ["STEP_KINDS", "STEP_PATH", "Series", "StepMetrics", "StepPath"]
