"""What the gateway's handlers share: the served model (vocabulary, name, fingerprint, draft model), its route
planner, the pool for blocking work, and, on a gateway serving every model of a swarm, one of these per model."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from ..artifact.default_model import model_name, resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..client.opening import releases_done
from ..client.route import fetch_model_headers
from ..client.speculative import METHODS, check_draft_max
from ..client.tokenizer import Tokenizer
from ..client.transport import new_http_session
from ..directory.lookup import DirectoryError
from ..directory.trackers import TrackerClient, TrackerError
from .config import GatewayConfig
from .errors import RequestError
from .planner import NodeTimings, RoutePlanner, Suspects
from .responses_store import ResponseStore
from .verify import Verifier

if TYPE_CHECKING:
    from ..client.draft_model import DraftModel

log = logging.getLogger(__name__)

LISTING_S = 10.0  # with the DHT: how often (s) the gateway lists the swarm's nodes in the background
HEADER_FETCH_TIMEOUT_S = 30.0  # most seconds a route's first node may take to send the model's headers
RELEASE_WAIT_S = 5.0  # at shutdown, how long the gateway waits for closed sessions to release their nodes


class Gateway:
    """One served model: its vocabulary (``tokenizer``, loaded by ``load``), ``model_name``, ``fingerprint`` and
        ``planner``; ``pool`` runs blocking work (tokenizing, loading); ``http`` is the session its routes talk over
    (``start``). ValueError for contradictory speculative
        settings."""

    def __init__(self, config: GatewayConfig, parent: Gateway | None = None):
        if config.speculative not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {config.speculative!r}")
        check_draft_max(config.draft_max)
        if (config.speculative == "draft") != bool(config.draft_model):
            raise ValueError(
                "speculative draft needs a draft model (--draft-model PATH), and a draft model needs "
                "--speculative draft"
            )
        if config.speculative == "draft" and config.tracker and not config.model:
            raise ValueError(
                "speculative draft needs the served model named (--model): a draft model drafts for one vocabulary"
            )
        self.config = config
        self.draft: DraftModel | None = None  # loaded with the vocabulary (load)
        self.tokenizer: Tokenizer | None = None
        self.model_name = config.model_name
        self.fingerprint: str | None = None  # the model's GGUF header fingerprint (load)
        self.swarm = None  # with a tracker: the swarm that fetched the header (it seeds it)
        self._root = parent or self
        if parent is None:
            self._http: aiohttp.ClientSession | None = None  # started on the app's loop (start)
            self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="gateway")
            self.suspects = Suspects(TrackerClient(config.tracker, config.token) if config.tracker else None)
            self.timings = NodeTimings()  # each node's decode time as this gateway measured it (placement sanity)
            self.created = int(time.time())
            trackers = (config.tracker, *config.more_trackers)
            # a fixed --route has no other node to replay a hop on: it does not verify (nor ask for commitments)
            rate = config.verify_rate if config.tracker or config.dht else 0.0
            self.verifier = Verifier(rate, trackers, config.token, config.session_lease_s)
            self.responses = ResponseStore()  # /v1/responses with store: true (gateway/responses_store.py)
        else:  # one model of a gateway serving every model: the pool, what failed lately and the bans are shared
            self.pool, self.suspects, self.created = parent.pool, parent.suspects, parent.created
            self.timings = parent.timings
            self.verifier = parent.verifier
            self.responses = parent.responses
        # --join with DHT contacts: routes planned from the DHT when no tracker answers (directory.lookup)
        self.discovery = parent.discovery if parent is not None else self._discovery(config)
        self.planner = RoutePlanner(config, self.suspects, self.model_name, None, self.discovery)
        self.planner.timings = self.timings
        self.verifier.attach(self.planner)
        self._refresh: asyncio.Task | None = None  # with the DHT: the background listing (_keep_listing)
        self._models: dict[str, Gateway] = {}
        self._models_lock = threading.Lock()

    @staticmethod
    def _discovery(config: GatewayConfig):
        """The gateway's own DHT session (net.dht.Discovery), bootstrapped from ``config.dht``; None without."""
        if not config.dht:
            return None
        from ..net.dht import Discovery

        return Discovery.standalone(config.host, config.dht_port, list(config.dht))

    async def start(self) -> None:
        """On the app's event loop, at startup: the aiohttp session every route session talks over, and the
        vocabulary (``load``, in the pool)."""
        await asyncio.get_running_loop().run_in_executor(self.pool, self.load)
        self._http = new_http_session()
        if self.discovery is not None:
            self._refresh = asyncio.create_task(self._keep_listing())

    async def _keep_listing(self) -> None:
        """With the DHT: list the swarm's nodes every LISTING_S seconds (trackers, the DHT, peers' peers), so the
        directory knows the nodes to ask should the tracker go away, before a request needs them."""
        while True:
            try:
                await self.planner.directory.nodes(self.http)
            except (DirectoryError, TrackerError):
                pass
            await asyncio.sleep(LISTING_S)

    async def stop(self) -> None:
        """At shutdown: let the sessions of cancelled requests release their nodes, close the aiohttp session,
        stop the pool."""
        if self._refresh is not None:
            self._refresh.cancel()
        if self._root is self:
            await self.verifier.close()
        await releases_done(RELEASE_WAIT_S)
        if self._http is not None:
            await self._http.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.discovery is not None and self._root is self:
            self.discovery.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        """The aiohttp session route sessions and the tracker are asked through (one connection pool)."""
        return self._root._http

    @property
    def every_model(self) -> bool:
        """Whether this gateway serves every model of its tracker's swarm (``--tracker`` without ``--model``):
        each request's ``model`` picks one, loaded on first use (``for_model``)."""
        return bool(self.config.tracker) and self.config.model is None and self.config.model_name is None

    def suspect(self, url: str) -> None:
        """Avoid node ``url`` in new routes for a while (see planner.Suspects)."""
        self.suspects.add(url)

    def for_model(self, name) -> Gateway:
        """The gateway of model ``name`` (blocking: fetches its header from the swarm the first time). Only on
        a gateway serving every model. RequestError 400 without a name, 404 ``model_not_found`` for a model
        the swarm has not published; TrackerError when the tracker cannot be reached."""
        if not isinstance(name, str) or not name:
            raise RequestError(
                "model is required: this gateway serves every model of its swarm (GET /v1/models lists them)",
                param="model",
            )
        with self._models_lock:
            found = self._models.get(name)
        if found is not None:
            return found
        child = Gateway(replace(self.config, model=name), parent=self)
        try:
            child.load()
        except TrackerError as exc:
            if exc.status == 404:
                raise RequestError(
                    f"model {name!r} is not published in this swarm (GET /v1/models lists the models it can serve)",
                    404,
                    "model_not_found",
                    "model",
                ) from None
            raise
        with self._models_lock:
            return self._models.setdefault(name, child)

    def _fetch_header(self) -> Path:
        """The model's GGUF header (vocabulary, chat template) on local disk, fetched from the swarm: the manifest
        from the tracker, or (``--join``, the tracker not answering) from a node the DHT lists, checked against the
        join link's model identity; the header's pieces from the torrent's peers, verified by BitTorrent. Raises
        TrackerError, DirectoryError (no source has the manifest), SwarmError."""
        from ..net.addresses import listen_host_toward
        from ..swarm.shard_fetch import fetch_header
        from ..swarm.torrent import Swarm

        data_dir = Path(self.config.data_dir)
        # the header's pieces come from peers the tracker or the DHT names: the swarm session binds where those are
        # reached from, whatever address the API listens on
        peers_at = listen_host_toward([self.config.tracker, *self.config.more_trackers, *self.config.dht])
        if self.discovery is None:
            swarm = Swarm(peers_at or "127.0.0.1")
            path, self.swarm = fetch_header(
                self.config.tracker, self.model_name, data_dir, token=self.config.token, swarm=swarm
            )
            return path
        swarm = Swarm(peers_at or self.config.host, 0, dht_bootstrap=list(self.config.dht))
        self.planner.model_name = self.model_name
        directory = self.planner.directory
        path, self.swarm = fetch_header(None, self.model_name, data_dir, directory=directory, swarm=swarm)
        return path

    def load(self) -> None:
        """Read the GGUF header and vocabulary (blocking): from ``--model``; with a tracker, fetched from the
        swarm (header only); with ``--route`` and no ``--model``, fetched from the route's first node (its
        headers: the model is whatever the route serves). ``fingerprint`` is then the model's identity, which
        every node of every route must share. Raises GGUFError / OSError / TrackerError / RouteError."""
        if self.every_model:
            return  # each model is loaded on first use (for_model)
        if self.config.tracker or self.discovery is not None:
            self.model_name = self.config.model or self.config.model_name
            path = self._fetch_header()
        elif self.config.model is None and self.config.route:
            path, info = fetch_model_headers(
                self.config.route[0],
                Path(self.config.data_dir),
                min(self.config.hop_timeout_s, HEADER_FETCH_TIMEOUT_S),
                token=self.config.token,
            )
            self.model_name = self.model_name or info["name"]
        else:
            path = resolve_model(self.config.model)
        file = GGUFModelFile(path)
        self.tokenizer = Tokenizer(str(file.path), file.metadata)
        if self.config.chat_template:  # --chat-template-file: used instead of the GGUF's
            self.tokenizer.chat_template = self.config.chat_template
        self.fingerprint = file.fingerprint
        self.model_name = self.model_name or model_name(self.config.model, file.path)
        self.planner.model_name, self.planner.fingerprint = self.model_name, self.fingerprint
        if self.config.speculative == "draft" and self.draft is None:  # ValueError: another vocabulary
            from ..client.draft_model import DraftModel  # (loads llama.cpp: only with --draft-model)

            self.draft = DraftModel(
                self.config.draft_model,
                file.metadata,
                sessions=self.config.draft_sessions,
                threads=self.config.draft_threads,
            )
