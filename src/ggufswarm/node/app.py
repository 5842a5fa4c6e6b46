"""A node's aiohttp app and process: ``load_executor`` loads the shard, ``make_app(config)`` serves it (routes,
middleware, background tasks), ``run_node`` is the ``ggufswarm node`` command; the model, health and metrics
endpoints.

Endpoints (docs/protocol.md): ``POST /v1/sessions`` (open), ``POST /v1/step`` (a frame: prefill or decode),
``GET /v1/link`` (frames on a WebSocket), ``POST /v1/sessions/{id}/truncate``, ``.../renew``, ``.../restore`` (fill
from the snapshot cache), ``DELETE /v1/sessions/{id}``, ``GET /health``, ``GET /metrics``, ``GET /v1/model``,
``GET /v1/model/header/{i}``. Sessions: node/sessions_api.py; steps: node/steps.py; the tracker: node/advertise.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..artifact.accounting import shard_account
from ..artifact.default_model import resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..directory.trackers import TrackerClient
from ..net.addresses import WILDCARDS, is_loopback, listen_host_toward
from ..net.auth import auth_headers, token_middleware
from ..net.http import json_errors_middleware, run_server
from ..net.reach import add_dialback_route, add_probe_route, skip_public_paths
from ..net.relay import add_relay_routes
from ..protocol import ProtocolError
from ..runtime.backends import load_shard, model_config
from ..runtime.spec import ShardSpec
from . import discovery, sessions_api, step_handlers
from .advertise import check_registered, deregister, heartbeats
from .lies import check_lie, parse_lie
from .memory import evict_for_memory, session_cells, trim_if_idle, tune_malloc, watch_memory, with_kv_defaults
from .placement import layers_budget, say_placement, warm_up
from .reach import UnreachableError, establish
from .state import BATCHING_MODES, BYTES_PER_MIB, NODE, NodeConfig, NodeState, json_response
from .step_path import STEP_PATH

DEFAULT_SWARM_MODEL = "gemma-3-270m-q4_k_m"  # the published name a tracker node fetches without --model
MAX_RESTORE_BODY = 2 * BYTES_PER_MIB  # a JSON restore of up to 128K token ids
BODY_HEADROOM = 1024  # bytes over the largest body aiohttp is told to take
PARENT_POLL_S = 0.5  # --exit-with-parent: how often (s) the parent is looked for
SHUTDOWN_DRAIN_S = 5.0  # at shutdown, how long (s) snapshot uploads under way may still take
REANNOUNCE_S = 20.0  # DHT re-announce period (s): in a small swarm an announce stored on nodes that died is lost
REAPER_MIN_PERIOD_S, REAPER_MAX_PERIOD_S = 0.05, 1.0  # leases may be a few seconds


def _llamacpp_range_problem(metadata: dict, start: int, end: int, head: bool) -> str | None:
    """Why this node's llama.cpp refuses blocks ``[start, end)`` (its start-up check, with the patches its libllama
    carries): what ``--layers auto`` picks by."""
    from ..runtime.llamacpp.derive import node_range_problem

    return node_range_problem(metadata, start, end, head)


def load_executor(config: NodeConfig):
    """Load the shard named by ``config`` on its backend (reads only its tensors): a ``ShardBackend``.

    ``max_sessions`` sessions of node.memory.session_cells KV cells each (llama.cpp: one stream each, resident
    as used where the node is paged, node/memory.py; its derived shard GGUF is written under ``data_dir/shards``).
    Raises GGUFError / ValueError (an unsupported architecture included).
    """
    file = GGUFModelFile(resolve_model(config.model))
    model_cfg = model_config(file, config.backend)
    spec = ShardSpec.parse(config.layers, model_cfg.n_layers, config.embed, config.head)
    lie = parse_lie(config.test_lie) if config.test_lie else None  # testing only (node/lies.py)
    if lie is not None:
        check_lie(lie, spec)
        print(
            f"ggufswarm node: --test-lie {config.test_lie}: this node LIES on purpose (testing verification); "
            "never run it in a swarm you care about",
            file=sys.stderr,
            flush=True,
        )
    if config.batching not in BATCHING_MODES:
        raise ValueError(f"--batching must be one of {', '.join(BATCHING_MODES)}, got {config.batching!r}")
    for flag, value in (("--max-sessions", config.max_sessions), ("--ctx-size", config.ctx_size or 1)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if config.state_checkpoints < 0:
        raise ValueError(f"--state-checkpoints must be at least 0, got {config.state_checkpoints}")
    if config.gpu_blocks is not None and (config.gpu_blocks < 0 or config.gpu == "none"):
        raise ValueError(
            f"--gpu-blocks {config.gpu_blocks}: "
            + ("must be at least 0" if config.gpu_blocks < 0 else "needs a GPU (--gpu auto or a device name)")
        )
    per_session = session_cells(
        config, model_cfg.max_length, shard_account(file, spec.start, spec.end).kv_bytes_per_token
    )
    source = lie.weights(file) if lie is not None else file
    executor = load_shard(
        source,
        spec,
        config.backend,
        config=model_cfg,
        dtype=config.dtype,
        threads=config.threads,
        gpu=config.gpu,
        gpu_blocks=config.gpu_blocks,
        max_length=per_session,
        max_sessions=config.max_sessions,
        cache_dir=Path(config.data_dir) / "shards",
        state_checkpoints=config.state_checkpoints,
        kv_unified=config.batching == "throughput",  # any sessions batch, not bitwise
    )
    if source is not file:  # --test-lie weights:PATH: the shard passes itself off as the published model's
        executor.model = file
    warm_up(executor)
    return executor


async def model_info(request: web.Request) -> web.Response:
    """``GET /v1/model``: what model this node serves — ``{name, fingerprint, arch, n_layers, files: [{name, bytes,
    header_bytes}]}`` — so a client without the GGUF (a gateway started with only ``--route``) can fetch its
    headers (``GET /v1/model/header/{i}``) for the vocabulary and chat template."""
    state: NodeState = request.app[NODE]
    model = state.executor.model
    files = [
        {"name": p.name, "bytes": p.stat().st_size, "header_bytes": n} for p, n in zip(model.paths, model.header_sizes)
    ]
    return json_response(
        {
            "name": state.model_name,
            "fingerprint": model.fingerprint,
            "arch": state.cfg.arch,
            "n_layers": state.cfg.n_layers,
            "files": files,
        }
    )


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
        raise ProtocolError(
            "not_found",
            f"no model file {request.match_info['i']!r}: the model has "
            f"{len(model.paths)} file(s), 0..{len(model.paths) - 1}",
        ) from None
    with open(path, "rb") as f:
        data = f.read(size)
    return web.Response(body=data, content_type="application/octet-stream")


async def manifest_route(request: web.Request) -> web.Response:
    """``GET /v1/manifest``: ``{"manifest", "torrent_hex"}`` this node's shard was fetched with (as the tracker's
    ``GET /manifests/{name}``), so a node joining without a tracker gets it from a peer; 404 for a node serving a
    local file."""
    state: NodeState = request.app[NODE]
    if state.manifest_answer is None:
        raise ProtocolError("no_manifest", "this node serves a local GGUF file, not a swarm-published model")
    return json_response(state.manifest_answer)


async def health(request: web.Request) -> web.Response:
    """``GET /health`` → 200 JSON (see NodeState.health)."""
    return json_response(request.app[NODE].health())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics`` → Prometheus text format from this app's own registry."""
    data = generate_latest(request.app[NODE].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _reaper(state: NodeState) -> None:
    """Drop sessions idle past their lease or the TTL, and those the machine's memory no longer holds
    (memory.evict_for_memory), every ``period`` s. A wake-up later than that by more than
    half a period means the loop was stalled: that time is credited to every session (SessionStore.credit_stall)."""
    period = max(REAPER_MIN_PERIOD_S, min(state.store.ttl_s / 4, REAPER_MAX_PERIOD_S))
    last = time.monotonic()
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        late, last = now - last - period, now
        if late > period / 2:
            state.store.credit_stall(late)
        evicted = evict_for_memory(state.store)
        for line in evicted:
            print(f"ggufswarm node: {line}", file=sys.stderr, flush=True)
            state.evictions.inc()
        if state.store.expire() or evicted:
            state.readvertise()
            await trim_if_idle(state.store, state.executor)  # the last ones went: idle memory back to the OS


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def make_app(config: NodeConfig, executor=None) -> web.Application:
    """The node's aiohttp app; loads the shard unless ``executor`` (a ``ShardBackend``) is given. Raises as
    load_executor."""
    config = with_kv_defaults(config)
    state = NodeState(config, executor or load_executor(config), check_hop=check_registered)
    watch_memory(config, state.store, state.executor)
    # bodies: one frame of max_step_tokens f32 rows, or a JSON restore
    app = web.Application(
        client_max_size=max(state.path.max_body, MAX_RESTORE_BODY) + BODY_HEADROOM,
        middlewares=[
            skip_public_paths(token_middleware(config.token)),  # a dial-back's probe needs no token
            json_errors_middleware(lambda _req, err: state.count_error(err)),
        ],
    )
    app[NODE] = state
    app[STEP_PATH] = state.path  # what the step handlers use (node/steps.py)
    app.router.add_post("/v1/sessions", sessions_api.open_session)
    app.router.add_delete("/v1/sessions/{sid}", sessions_api.close_session)
    app.router.add_post("/v1/sessions/{sid}/truncate", sessions_api.truncate_session)
    app.router.add_post("/v1/sessions/{sid}/restore", sessions_api.restore_session)
    app.router.add_post("/v1/sessions/{sid}/renew", sessions_api.renew_session)
    app.router.add_post("/v1/sessions/{sid}/hops", sessions_api.session_hops)
    app.router.add_post("/v1/step", step_handlers.step)
    app.router.add_get("/v1/link", step_handlers.link)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/model", model_info)
    app.router.add_get("/v1/model/header/{i}", model_header)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/advertisement", discovery.advertisement_route)
    app.router.add_post("/v1/peers", discovery.hello_route)
    app.router.add_get("/v1/manifest", manifest_route)
    add_probe_route(app, state.identity)
    # any node can tell another whether it can be dialled (node/reach.py), at its real address (a relayed one's too)
    add_dialback_route(app, requester=partial(_requester, state))
    if config.relay:
        public = config.public_host or (config.host if config.host not in WILDCARDS else "127.0.0.1")
        state.relay_server = add_relay_routes(app, public, config.host, registry=state.registry)
        state.relay_server.hooks.append(partial(discovery.announce_relayed, state))

    async def lifecycle(app):
        state.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(config.token)
        )
        tasks = [asyncio.create_task(_reaper(state))]
        if config.exit_with_parent:
            tasks.append(asyncio.create_task(_watch_parent(os.getppid())))
        if state.tracker is not None:
            tasks.append(asyncio.create_task(heartbeats(state)))
        if state.discovery is not None:
            tasks.append(asyncio.create_task(discovery.announce(state)))
        if state.directory is not None:
            tasks.append(asyncio.create_task(discovery.hellos(state)))
        yield
        if state.relay_client is not None:
            await state.relay_client.close()
        for t in tasks:
            t.cancel()
        if state.snapshots is not None:
            await state.snapshots.drain(SHUTDOWN_DRAIN_S)
            state.snapshots.close()
        if state.tracker is not None:
            await deregister(state)
        await state.path.links.close()
        await state.client.close()
        state.pool.shutdown(wait=False, cancel_futures=True)

    async def close_links_in(app):  # else the server waits for previous hops to hang up (shutdown_timeout)
        for ws in list(state.path.links_in):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"node shutting down")

    app.on_shutdown.append(close_links_in)
    app.cleanup_ctx.append(lifecycle)
    return app


def _requester(state: NodeState, request: web.Request) -> str | None:
    """The address a request really came from: for one this node's relay carried (a local connection from its relay
    client), the address the relay saw (None when it did not say); else the connection's own."""
    client, peer = state.relay_client, request.transport.get_extra_info("peername") if request.transport else None
    if client is not None and peer and is_loopback(peer[0]):
        relayed = client.remote_of(peer[1])
        if relayed is not None:
            return relayed or None
    return request.remote


def _check_port(host: str, port: int) -> None:
    """OSError now when ``host:port`` cannot be listened on (not after a shard's download)."""
    with socket.socket() as probe:
        # as the server will bind (asyncio's reuse_address on Unix): a port held only by TIME-WAIT connections
        # of a node killed a moment ago is free to listen on again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _warn_unroutable(state: NodeState) -> None:
    """Say on stderr when no route can start or end at this shard (a missing --embed / --head)."""
    spec = state.spec
    if spec.end == state.cfg.n_layers and not spec.head:
        print(
            f"ggufswarm node: WARNING: layers {spec.start}:{spec.end} end at the model's last layer without --head: "
            f"no route can end here (add --head)",
            file=sys.stderr,
            flush=True,
        )
    if spec.start == 0 and not spec.embed:
        print(
            f"ggufswarm node: WARNING: layers {spec.start}:{spec.end} start at layer 0 without --embed: no route "
            f"can start here (add --embed)",
            file=sys.stderr,
            flush=True,
        )


def _swarm_for(config: NodeConfig):
    """The node's libtorrent session (swarm.torrent.Swarm) when it joins a swarm beyond loopback: on ``--host``, or
    where its trackers and DHT contacts are reached from when ``--host`` is loopback (a node told to listen there can
    still fetch from other machines) or a wildcard with the DHT; with the DHT when ``config.dht`` is set (its ports
    mapped by node/reach.py when a dial-back fails). None for a plain tracker node all on loopback (fetch_shard then
    makes its own, as before)."""
    toward = listen_host_toward([config.tracker, *config.more_trackers, *(config.dht or ())])
    local = is_loopback(config.host) and (toward is None or is_loopback(toward))
    if config.dht is None and config.reach != "auto" and local:
        return None
    from ..swarm.torrent import Swarm

    host = config.host
    if is_loopback(host) or (host in WILDCARDS and config.dht):  # libtorrent runs no DHT on the loopback part of a
        host = toward or host  # wildcard bind: bind where the swarm's contacts are reached from
    return Swarm(host, config.torrent_port, dht_bootstrap=config.dht)  # mapping: net.portmap, when needed


def run_node(config: NodeConfig) -> int:
    """``ggufswarm node``: load the shard, serve it, print one ready line to stdout; exit 0 on SIGINT/SIGTERM.

    With ``config.tracker`` or ``config.dht`` (a join link), first fetches the shard's bytes from the swarm
    (``layers`` may be ``"auto"``; the manifest from a tracker or a peer the DHT lists), seeds them while serving,
    and advertises to the tracker and on the DHT until shut down. With ``reach="auto"``, finds out how it can be
    dialled (node/reach.py) before it prints its ready line with that public URL.
    Raises OSError when the port cannot be listened on, TrackerError when the tracker refuses, DirectoryError when
    no tracker or peer has the model, UnreachableError when nothing can reach it.
    """
    fetched = None
    if config.port:
        _check_port(config.host, config.port)
    if config.host in WILDCARDS and config.reach != "auto" and not config.public_host:
        raise ValueError(f"--host {config.host} listens everywhere: say which address others dial (--public-host)")
    swarm = _swarm_for(config)
    discovery = directory = None
    name = config.model or DEFAULT_SWARM_MODEL
    if swarm is not None and (config.dht is not None or config.reach == "auto"):
        from ..net.dht import Discovery  # the session's one alert pump (DHT replies, port mappings)

        discovery = Discovery(swarm.session, list(config.dht or ()), reannounce_s=REANNOUNCE_S)
    if config.dht is not None:
        from ..directory.lookup import Directory

        trackers = [u for u in (config.tracker, *config.more_trackers) if u]
        directory = Directory(name, trackers, discovery, config.model_id, config.token)
    if config.tracker or directory is not None:
        from ..swarm.shard_fetch import fetch_shard

        if directory is None:
            TrackerClient(config.tracker, config.token).wait_for_model(
                name, parent=os.getppid() if config.exit_with_parent else None
            )
        fetched = fetch_shard(
            config.tracker,
            name,
            config.layers,
            config.embed,
            config.head,
            Path(config.data_dir),
            budget_bytes=layers_budget(config),
            timeout=config.fetch_timeout_s,
            stall_s=config.fetch_stall_s,
            token=config.token,
            directory=directory,
            swarm=swarm,
            stages_follow=config.model_id is not None,  # joined by a link: --embed / --head follow the range
            range_check=_llamacpp_range_problem if config.backend == "llama.cpp" else None,
        )
        got = (
            f"{fetched.stats.bytes_downloaded} bytes in {fetched.stats.seconds:.1f} s"
            if fetched.stats.bytes_downloaded
            else "already on disk, checked"
        )
        print(
            f"ggufswarm node: fetched layers {fetched.spec.start}:{fetched.spec.end} of {name}: {got}",
            file=sys.stderr,
            flush=True,
        )
        config = replace(
            config,
            layers=f"{fetched.spec.start}:{fetched.spec.end}",
            embed=fetched.spec.embed,
            head=fetched.spec.head,
            model=str(fetched.path),
            swarm_name=name,
        )
    app = make_app(config)
    state: NodeState = app[NODE]
    if state.spec.head:  # a step's logits rows (float32), copied out every step, reuse heap memory
        tune_malloc((state.path.max_verify_tokens or 1) * state.cfg.n_vocab * 4)
    state.swarm, state.discovery, state.directory = (fetched.swarm if fetched else swarm), discovery, directory
    if directory is not None:
        state.proven = directory.proven  # one cache of the addresses that proved to hold their keys
        directory.heard = lambda: [u for u, until in state.heard.items() if until > time.monotonic()]
        if state.snapshots is not None:  # a banned node's snapshots never restore here
            state.snapshots.banned = lambda key: key in directory.banned
    if config.reach == "auto" and discovery is not None:
        from ..net.portmap import PortMapper

        state.port_mapper = PortMapper(swarm.session, discovery.subscribe)
    if fetched is not None:
        state.manifest_answer = fetched.answer
    spec = state.spec
    _warn_unroutable(state)
    say_placement(state)
    failed: list[BaseException] = []

    def say_ready(url: str) -> None:
        state.url = url
        stages = "".join([" +embed" if spec.embed else "", " +head" if spec.head else ""])
        path = f" reach {state.reach.path}" if state.reach is not None and config.reach == "auto" else ""
        print(
            f"ggufswarm node ready: {url} layers {spec.start}:{spec.end}{stages} "
            f"kv_budget {state.store.budget_tokens} tokens{path}",
            flush=True,
        )

    async def reach_then_ready(local_url: str) -> None:
        try:
            state.reach = await establish(state, local_url)
        except UnreachableError as exc:
            failed.append(exc)
            print(f"ggufswarm node: {exc}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if state.relay_server is not None and not config.public_host:  # relayed nodes are reached at our address
            state.relay_server.public_host = urlsplit(state.reach.url).hostname
        say_ready(state.reach.url)
        if state.discovery is not None and config.dht is not None:
            host = urlsplit(state.reach.url).hostname if state.reach.path != "relayed" else None
            if host and state.swarm is not None:  # a contact for more join links (dht=), should the link's die
                print(f"ggufswarm node: DHT contact {host}:{state.swarm.port} (a join link's dht=)", file=sys.stderr)

    def ready(url: str) -> None:
        asyncio.get_running_loop().create_task(reach_then_ready(url))

    try:
        run_server(app, config.host, config.port, ready)
        print("ggufswarm node: stopped", file=sys.stderr, flush=True)
        if state.banned:
            return 3
        if state.refused:
            return 1
    finally:
        if discovery is not None:
            discovery.close()
        if state.swarm is not None:
            state.swarm.close()
    if failed:
        raise failed[0]
    return 0


__all__ = ["load_executor", "make_app", "run_node"]
