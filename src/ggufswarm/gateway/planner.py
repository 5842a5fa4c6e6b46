"""Where a request's session runs: the gateway's route-planning policy. A fixed ``--route`` (checked once), or a
route planned by the tracker per session, avoiding nodes that failed lately (reported to the tracker), falling
back to a shorter session when no route holds the whole request, and planning again when opening fails on a node."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import aiohttp

from ..artifact.accounting import MAX_CONTEXT
from ..client.route import Hop, RemoteRoute
from ..client.transport import REPAIRABLE
from ..directory.lookup import Directory
from ..directory.trackers import TrackerClient, TrackerError
from ..protocol.errors import RouteError
from ..runtime.sampling import SamplingParams
from .config import GatewayConfig
from .errors import RequestError
from .params import RequestOptions

log = logging.getLogger(__name__)

SUSPECT_S = 30.0  # how long new routes avoid a node that failed (the tracker forgets it after its TTL)
OPEN_ATTEMPTS = 3  # plans tried for one session when opening it fails on a node
REPORT_TIMEOUT_S = 10.0  # POST /nodes/report: how long the tracker may take to check a reported node


class Suspects:
    """Node URLs that failed an open or a step lately: new routes avoid each for SUSPECT_S seconds. Shared by the
    models of a gateway serving every model; thread-safe. With a ``tracker``, a newly suspected node is reported
    to it (``POST /nodes/report``, in the background): the tracker checks the node and, when it is down, stops
    routing anyone to it before its TTL runs out."""

    def __init__(self, tracker: TrackerClient | None):
        self.tracker = tracker
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}  # node URL -> until when new routes avoid it (monotonic s)

    def add(self, url: str) -> None:
        """Avoid ``url`` in new routes for SUSPECT_S seconds (reporting it to the tracker if newly suspected)."""
        now = time.monotonic()
        with self._lock:
            new = self._until.get(url, 0.0) <= now
            self._until[url] = now + SUSPECT_S
        if new and self.tracker is not None:
            threading.Thread(target=self._report, args=(url,), name="report-node", daemon=True).start()

    def _report(self, url: str) -> None:
        try:
            self.tracker.report(url, timeout_s=REPORT_TIMEOUT_S)
        except TrackerError as exc:  # best effort: the node's TTL still runs out
            log.info("reporting node %s to the tracker failed: %s", url, exc.reason)

    def current(self) -> set[str]:
        """Node URLs new routes avoid now."""
        now = time.monotonic()
        with self._lock:
            self._until = {u: t for u, t in self._until.items() if t > now}
            return set(self._until)


class NodeTimings:
    """Each node's decode time as this gateway measured it from outside (placement sanity, docs/protocol.md): per
    finished session, the median over its one-token decode steps of the node's share of the step
    (``StepTiming.own_ms``: what the hop before it waited, less what the node waited for the next one), folded into a
    running mean per node key (``ALPHA`` for the newest session). Route planning never counts a node faster than
    this (``GET /route``'s ``measured``), so a node that advertises speed it does not have gets no more routes than
    its measured time earns. Thread-safe; shared by the models of a gateway."""

    ALPHA = 0.5  # weight of the newest session's median
    MAX_NODES = 256  # nodes remembered: the most recently measured
    MAX_SENT = 64  # of which sent with a route query (~4.7 KB of URL: aiohttp takes request lines of 8190 bytes)

    def __init__(self):
        self._lock = threading.Lock()
        self._ms: dict[str, float] = {}  # node key -> ms per decode step, insertion order = least recently measured

    def observe(self, session) -> None:
        """Fold in what a finished route session (client.session.AsyncRouteSession) measured of each of its hops."""
        keys = {h.url: h.node_id for h in session.route.hops if getattr(h, "node_id", None)}
        shares: dict[str, list[float]] = {}
        for step in session.measured.steps:
            if step.n_tokens != 1 or step.verify or len(step.outer_ms) != len(step.urls):
                continue
            for url, ms in zip(step.urls, step.own_ms()):
                if url in keys:
                    shares.setdefault(keys[url], []).append(ms)
        with self._lock:
            for key, values in shares.items():
                median = sorted(values)[len(values) // 2]
                old = self._ms.pop(key, None)
                self._ms[key] = median if old is None else self.ALPHA * median + (1 - self.ALPHA) * old
            while len(self._ms) > self.MAX_NODES:
                del self._ms[next(iter(self._ms))]

    def get(self, key: str) -> float | None:
        """The measured ms per decode step of node ``key``, or None."""
        with self._lock:
            return self._ms.get(key)

    def query(self) -> str:
        """``GET /route``'s ``measured`` parameter: ``key:ms,...`` ("" when nothing is measured yet)."""
        with self._lock:
            recent = list(self._ms.items())[-self.MAX_SENT :]
        return ",".join(f"{k}:{v:.3f}" for k, v in recent)


class RoutePlanner:
    """Routes and sessions of one served model (``model_name``, GGUF header ``fingerprint``: every node of every
    route must serve it), on the gateway's event loop: the tracker and the nodes are asked through ``http`` (the
    gateway's aiohttp session)."""

    def __init__(
        self,
        config: GatewayConfig,
        suspects: Suspects,
        model_name: str | None,
        fingerprint: str | None,
        discovery=None,
    ):
        self.config, self.suspects = config, suspects
        self.model_name, self.fingerprint = model_name, fingerprint
        self.tracker = TrackerClient(config.tracker, config.token) if config.tracker else None
        self.discovery = discovery  # a net.dht.Discovery (``--join`` with DHT contacts): routes without a tracker
        self._directory: Directory | None = None
        self.verifier = None  # the gateway's verify.Verifier (``attach``): its bans are never planned through
        self.timings = NodeTimings()  # replaced by the gateway's shared one (gateway/state.py)
        self._fixed: RemoteRoute | None = None
        self._fixed_lock = asyncio.Lock()

    @property
    def planned(self) -> bool:
        """Whether routes are planned per session (a tracker or the DHT), not one fixed ``--route``."""
        return self.tracker is not None or self.discovery is not None

    @property
    def directory(self) -> Directory:
        """Where this model's nodes are listed: the tracker, then the DHT (directory.lookup)."""
        if self._directory is None or self._directory.model != self.model_name:
            self._directory = Directory(
                self.model_name or "",
                [u for u in (self.config.tracker, *self.config.more_trackers) if u],
                self.discovery,
                self.config.model_id,
                self.config.token,
            )
            for key in self.verifier.bans if self.verifier is not None else ():
                self._directory.ban(key)
        return self._directory

    async def route(
        self, http: aiohttp.ClientSession, max_length: int = 1, exclude=(), span: tuple[int, int] | None = None
    ) -> RemoteRoute:
        """A route for a session of ``max_length`` tokens. Raises RouteError (``no_route`` 503: the tracker has
        none; ``bad_route`` 502: one that does not serve this model).

        With a tracker, a new route is planned for every session (sticky for that session), so new sessions see
        nodes that came and went; ``max_length`` must fit every node's free KV. ``exclude`` (node URLs) and
        ``span`` (layers ``(start, end)``) plan a replacement for a failed hop. Nodes that failed lately
        (``suspects``) are avoided too, unless no route exists without them. Without one, the fixed route, asking
        each node's /health the first time.
        """
        if not self.planned:
            return await self._fixed_route(http)
        exclude = set(exclude) | (self.verifier.banned_urls() if self.verifier is not None else set())
        plans = [exclude | self.suspects.current(), exclude]  # then the suspects too: perhaps one is back
        for avoid in plans[:1] if plans[0] == plans[1] else plans:
            query = {"max_length": max_length}
            measured = self.timings.query()
            if measured:  # this gateway's own timing of nodes: a node never plans faster than that
                query["measured"] = measured
            if avoid:
                query["exclude"] = ",".join(sorted(avoid))
            if span:
                query["start"], query["end"] = span
            try:
                planned = await self.directory.route(http, query)
                hops = [Hop.from_advertisement(ad) for ad in planned["route"]]
                if all(hops):  # described by their advertisements: no /health round trip per node (TTFT)
                    return RemoteRoute.of_hops(
                        hops,
                        self.config.hop_timeout_s,
                        part=span is not None,
                        model=self.fingerprint,
                        token=self.config.token,
                    )
                return await RemoteRoute.connect(
                    [hop["url"] for hop in planned["route"]],
                    self.config.hop_timeout_s,
                    part=span is not None,
                    model=self.fingerprint,
                    token=self.config.token,
                    http=http,
                )
            except TrackerError as exc:
                # the tracker's reason, not its URL: API clients need not learn the swarm's addresses
                refused = RouteError("no_route", f"no route for a session of {max_length} tokens: {exc.reason}", 503)
            except ValueError as exc:
                raise RouteError(
                    "bad_route", f"bad route from the tracker: {exc} (this gateway's model: {self.model_name})", 502
                ) from None
        raise refused

    async def _fixed_route(self, http: aiohttp.ClientSession) -> RemoteRoute:
        if self._fixed is not None:
            return self._fixed
        async with self._fixed_lock:
            if self._fixed is None:
                try:
                    self._fixed = await RemoteRoute.connect(
                        self.config.route,
                        self.config.hop_timeout_s,
                        model=self.fingerprint,
                        token=self.config.token,
                        http=http,
                    )
                except ValueError as exc:
                    raise RouteError(
                        "bad_route", f"bad route: {exc} (this gateway's model: {self.model_name})", 502
                    ) from None
            return self._fixed

    async def open(
        self,
        http: aiohttp.ClientSession,
        ids: list[int],
        params: SamplingParams,
        opts: RequestOptions,
        prompt_param: str,
    ):
        """Plan a route and open a session for prompt ``ids`` and ``opts.max_tokens`` on it: ``(AsyncRouteSession,
        its max_length)``. With a tracker, a node of the plan that fails to open (the tracker still lists it) is
        suspected and the session planned again, OPEN_ATTEMPTS times at most (a node refusing its next hop as
        unknown, ``next_hop_unknown``: that next hop). RouteError; RequestError
        ``context_length_exceeded`` (param ``prompt_param``) for a prompt no route can hold."""
        max_tokens = opts.max_tokens

        async def once():
            route = await self._route_holding(http, ids, min(len(ids) + max(max_tokens, 1), MAX_CONTEXT), prompt_param)
            limit = route.max_length
            if len(ids) >= limit:
                raise RequestError(
                    f"prompt is {len(ids)} tokens; this route holds at most {limit}",
                    code="context_length_exceeded",
                    param=prompt_param,
                )
            # the prompt and every sampled token but the last: exactly what max_tokens needs (nothing more: the
            # head's ring decode then never runs a step past the last token, client/ring.py grant)
            max_length = min(limit, len(ids) + max(max_tokens - 1, 1))

            async def replan(exclude, span):  # repair: a replacement for a failed hop's span, from the tracker
                for url in exclude:  # nodes this session saw fail: new sessions avoid them too
                    self.suspects.add(url)
                return await self.route(http, max_length, exclude, span)

            session = await route.aopen(
                max_length,
                params,
                self.config.wire_dtype,
                top_logprobs=opts.top_logprobs,
                replan=replan if self.planned else None,
                lease_s=self.config.session_lease_s,
                logprobs=opts.logprobs,
                http=http,
                commit=self.verifier is not None and self.verifier.on,  # all: none can tell which are audited
            )
            return session, max_length

        for attempt in range(OPEN_ATTEMPTS):
            try:
                return await once()
            except RouteError as exc:
                if not self.planned or not exc.hop or attempt + 1 == OPEN_ATTEMPTS:
                    raise
                if exc.code in REPAIRABLE:
                    self.suspects.add(exc.hop)
                elif exc.code == "next_hop_unknown" and exc.next_hop:
                    # the node's own directory no longer lists its next hop (it just died, say) while this
                    # gateway's listing, up to CACHE_S old, still did: plan again without that one
                    self.suspects.add(exc.next_hop)
                else:
                    raise
        raise AssertionError("unreachable")

    async def _route_holding(
        self, http: aiohttp.ClientSession, ids: list[int], want: int, prompt_param: str
    ) -> RemoteRoute:
        """A route for ``want`` tokens; when no route has KV for that many, one that holds the prompt (the answer
        then ends at its length with finish_reason "length", as llama-server's does at its context)."""
        try:
            return await self.route(http, want)
        except RouteError as exc:
            if exc.code != "no_route":
                raise
            try:
                if want <= len(ids) + 1:
                    raise
                return await self.route(http, len(ids) + 1)
            except RouteError as held:
                if held.code != "no_route":
                    raise
                # Nothing holds the prompt now. When no node could ever (its sessions are shorter) that is the
                # request's fault, a 400 (not a 503 a client would retry); otherwise the nodes are busy: the 503.
                try:
                    longest = (await self.route(http, 1)).max_length
                except RouteError:
                    raise held from None
                if len(ids) >= longest:
                    raise RequestError(
                        f"prompt is {len(ids)} tokens; the longest session this swarm's nodes hold is {longest} tokens",
                        code="context_length_exceeded",
                        param=prompt_param,
                    ) from None
                raise held from None
