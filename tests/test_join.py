"""Issue 25 on loopback: a swarm joined by its link, that keeps serving and growing without its tracker.

One module-scoped swarm: a tracker (with a token), a publisher seeding Gemma 3 270M, node A (``node --join LINK
--dht -``: the swarm's first DHT node, on a fixed BitTorrent/DHT port), node B (``node --join LINK&dht=A``) and an
in-process gateway given the tracker *and* A's DHT contact. The first test that needs it stops the tracker and the
publisher (once: pytest-randomly runs the tests in any order); the swarm must keep answering (routes planned from
the DHT) and take a new node (``ggufswarm join``) whose layers come from A and B alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from route_fixtures import reference

from ggufswarm.directory.lookup import Directory, DirectoryError
from ggufswarm.directory.trackers import TrackerError
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.auth import TOKEN_ENV, TOKEN_HEADER
from ggufswarm.net.dht import Discovery, swarm_key
from ggufswarm.net.http import ServerThread
from ggufswarm.net.invite import JoinLink, JoinLinkError, manifest_digest
from ggufswarm.node.launch import NodeProcess, start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec
from ggufswarm.swarm.publish import publish
from ggufswarm.swarm.torrent import Swarm, save_path_for
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

NAME = "gemma"
TOKEN = "join-test-secret"
PROMPT = "The capital of France is"
MAX_TOKENS = 16
HOP_TIMEOUT = "10"
NODE_READY_S = 300.0  # start_nodes' bound for A and B (fetch + load; ~10-20 s each here)
FRESH_PLAN_BOUND_S = 40.0  # a new Directory plans from the DHT (see test_completions_continue_...)
JOIN_READY_BOUND_S = 60.0  # a node joining with the tracker and publisher gone: fetch from A/B + load + dial-back
DHT_LISTING_BOUND_S = 45.0  # usually < 1 s; the first node's announce may wait for its 20 s re-announce
AFTER_TRACKER_BOUND_S = 30.0  # the first completion once the tracker is gone (0.4 s by hand; 3-4 s measured here)


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (BitTorrent listens on TCP, the DHT on UDP)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                u.bind(("127.0.0.1", port))
        except OSError:
            continue
        return port
    raise RuntimeError("no free TCP+UDP port")


def http_json(url: str, body: dict | None = None, token: str | None = None, timeout: float = 120) -> tuple[int, dict]:
    headers = {TOKEN_HEADER: token} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(base: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> dict:
    status, body = http_json(
        f"{base}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=120
    )
    assert status == 200, body
    return body


def route_urls(body: dict) -> list[str]:
    return [hop["node"] for hop in body["telemetry"]["route"]]


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@contextlib.contextmanager
def dht_session(contact: str):
    """A fresh DHT session (net.dht.Discovery) bootstrapped from ``contact`` alone."""
    discovery = Discovery.standalone("127.0.0.1", 0, [contact])
    try:
        yield discovery
    finally:
        discovery.close()


async def _dht_urls(directory: Directory) -> set[str]:
    async with aiohttp.ClientSession() as http:
        return {str(a["url"]).rstrip("/") for a in await directory.dht_nodes(http, fresh=True)}


def wait_dht_lists(contact: str, model_id: str, want: set[str], bound_s: float = DHT_LISTING_BOUND_S) -> set[str]:
    """Poll the DHT (a fresh session) until every URL of ``want`` is listed (and answers its advertisement)."""
    with dht_session(contact) as discovery:
        directory = Directory(NAME, [], discovery, model_id, TOKEN)
        deadline = time.monotonic() + bound_s
        while True:
            found = asyncio.run(_dht_urls(directory))
            if want <= found:
                print(f"\nthe DHT listed {len(want)} nodes after {bound_s - (deadline - time.monotonic()):.1f} s")
                return found
            assert time.monotonic() < deadline, f"the DHT lists {sorted(found)}, not all of {sorted(want)}"
            time.sleep(0.3)


@dataclass
class JoinSwarm:
    tmp: Path
    tracker: ServerThread | None
    tracker_url: str
    seeder: Swarm | None
    model_id: str
    link: JoinLink  # as ``publish`` prints it: the tracker, the secret, no DHT contact
    contact: str  # node A's DHT contact (127.0.0.1:PORT)
    nodes: list[NodeProcess] = field(default_factory=list)  # A, B
    procs: list[subprocess.Popen] = field(default_factory=list)  # nodes started by the tests
    gateway: ServerThread | None = None
    gateway_url: str = ""
    live: list[str] = field(default_factory=list)  # the URLs of the one route the swarm has now (A, then a head)
    after_tracker: dict | None = None  # what stop_tracker_and_publisher measured

    @property
    def dht_link(self) -> str:
        """The link with A's DHT contact added (``LINK&dht=127.0.0.1:PORT``)."""
        return JoinLink(
            self.link.model, self.link.model_id, (self.contact,), self.link.trackers, (), self.link.secret
        ).format()

    def stop_tracker_and_publisher(self) -> None:
        """Once (the tests run in any order, pytest-randomly): wait until the DHT lists the live nodes, stop the
        tracker and the publisher's seeding, then time three greedy completions through the gateway
        (``after_tracker``: ``seconds``, ``bodies``, ``route`` the swarm had)."""
        if self.after_tracker is not None:
            return
        wait_dht_lists(self.contact, self.model_id, set(self.live))
        self.tracker.stop()
        self.tracker = None
        self.seeder.close()
        self.seeder = None
        with pytest.raises(OSError):  # really gone: the port refuses
            urllib.request.urlopen(self.tracker_url + "/health", timeout=5)
        seconds, bodies = [], []
        for _ in range(3):
            t0 = time.monotonic()
            bodies.append(complete(self.gateway_url))
            seconds.append(time.monotonic() - t0)
        self.after_tracker = {"seconds": seconds, "bodies": bodies, "route": list(self.live)}


@pytest.fixture(scope="module")
def swarm(gemma_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("join")
    tracker = ServerThread(make_tracker_app(TrackerConfig(db=":memory:", token=TOKEN)))
    tracker_url = tracker.start()
    s = None
    try:
        published = publish(gemma_path, tracker_url, NAME, tmp / "publisher", token=TOKEN)
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([gemma_path]))
        model_id = manifest_digest(json.loads(published.manifest.to_json()))
        link = JoinLink(NAME, model_id, trackers=(tracker_url,), secret=TOKEN)
        torrent_port = free_port()
        s = JoinSwarm(tmp, tracker, tracker_url, seeder, model_id, link, f"127.0.0.1:{torrent_port}")
        common = ["--hop-timeout", HOP_TIMEOUT]
        t0 = time.monotonic()
        with open(tmp / "a.err", "w") as err:
            s.nodes += start_nodes(
                [ShardSpec(0, 9, embed=True)],
                None,
                threads=1,
                timeout=NODE_READY_S,
                stderr=err,
                token=TOKEN,
                extra=[*common, "--join", link.format(), "--dht", "-", "--torrent-port", str(torrent_port)]
                + ["--data-dir", str(tmp / "a")],
            )
        with open(tmp / "b.err", "w") as err:
            s.nodes += start_nodes(
                [ShardSpec(9, 18, head=True)],
                None,
                threads=1,
                timeout=NODE_READY_S,
                stderr=err,
                token=TOKEN,
                extra=[*common, "--join", s.dht_link, "--data-dir", str(tmp / "b")],
            )
        print(f"\nnodes A and B ready in {time.monotonic() - t0:.1f} s: {[n.url for n in s.nodes]}")
        s.gateway = ServerThread(
            make_app(
                GatewayConfig(
                    [],
                    model=NAME,
                    tracker=tracker_url,
                    dht=(s.contact,),
                    model_id=model_id,
                    token=TOKEN,
                    data_dir=str(tmp / "gateway"),
                    hop_timeout_s=float(HOP_TIMEOUT),
                )
            )
        )
        s.gateway_url = s.gateway.start()
        s.live = [n.url for n in s.nodes]
        yield s
    finally:
        if s is not None:
            if s.gateway is not None:
                s.gateway.stop()
            for p in s.procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            stop_nodes(s.nodes)
            if s.seeder is not None:
                s.seeder.close()
            if s.tracker is not None:
                s.tracker.stop()
        else:
            tracker.stop()


# The tests run in any order (pytest-randomly): none needs the swarm's tracker alive; the two that need it dead
# stop it through JoinSwarm.stop_tracker_and_publisher, once; ``swarm.live`` is the route the swarm has now.


def test_greedy_completion_through_the_joined_swarm_equals_llama_cpp(swarm, gemma):
    want, _ = reference(gemma, PROMPT, MAX_TOKENS)
    out = complete(swarm.gateway_url)
    assert out["choices"][0]["text"] == want
    assert route_urls(out) == swarm.live
    hops = out["telemetry"]["hops"]
    assert [h["node"] for h in hops] == swarm.live
    assert [h["path"] for h in hops] == ["direct", "direct"], hops


def test_directory_refuses_a_manifest_other_than_the_links(swarm, tmp_path):
    """A Directory whose model_id is not the digest of the manifest it is handed refuses it, from a tracker and
    from a node the DHT lists (``GET /v1/manifest``) alike; the right id accepts both."""
    from apphost import AppThread

    from ggufswarm.directory.trackers import TrackerClient

    wrong = "0" * 64
    status, answer = http_json(swarm.live[0] + "/v1/manifest", token=TOKEN)
    assert status == 200, answer

    async def manifest(directory: Directory) -> dict:
        async with aiohttp.ClientSession() as http:
            return await directory.manifest(http)

    # a tracker of its own holding the swarm's manifest (the swarm's may be stopped already)
    with AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", token=TOKEN))) as tracker:
        TrackerClient(tracker, TOKEN).put_manifest(NAME, answer["manifest"], bytes.fromhex(answer["torrent_hex"]))
        found = asyncio.run(manifest(Directory(NAME, [tracker], None, swarm.model_id, TOKEN)))
        assert manifest_digest(found["manifest"]) == swarm.model_id
        with pytest.raises(DirectoryError, match="not the one the join link names") as err:
            asyncio.run(manifest(Directory(NAME, [tracker], None, wrong, TOKEN)))
        assert "refused" in str(err.value) and tracker in str(err.value)

    # DHT only (no tracker): the nodes' /v1/manifest answers, checked the same way
    wait_dht_lists(swarm.contact, swarm.model_id, set(swarm.live))
    with dht_session(swarm.contact) as discovery:
        from_peer = asyncio.run(manifest(Directory(NAME, [], discovery, swarm.model_id, TOKEN)))
        assert from_peer == found
        # a wrong id names a wrong DHT key too: nobody is listed there
        with pytest.raises(DirectoryError, match="the DHT lists no node"):
            asyncio.run(manifest(Directory(NAME, [], discovery, wrong, TOKEN)))

        # what the check is for: a peer listed under the swarm's key handing out a manifest of another digest
        # (here: a directory looking under the swarm's key while it expects another identity)
        class Forged(Directory):
            key = property(lambda self: swarm_key(swarm.model_id))

        with pytest.raises(DirectoryError, match="not the one the join link names") as err:
            asyncio.run(manifest(Forged(NAME, [], discovery, wrong, TOKEN)))
        assert all(f"{url}/v1/manifest" in str(err.value) for url in swarm.live), err.value


def test_node_endpoints_and_join_link_parsing(swarm, tiny_dir, tmp_path):
    from apphost import AppThread
    from tinymodels import write_tiny_model

    from ggufswarm.node.app import make_app as make_node_app
    from ggufswarm.node.state import NodeConfig

    a = swarm.live[0]
    # /v1/advertisement needs the swarm token; with it, the advertisement the tracker gets
    status, body = http_json(a + "/v1/advertisement")
    assert (status, body["error"]["code"]) == (401, "unauthorized"), body
    status, body = http_json(a + "/v1/advertisement", token="wrong")
    assert status == 401
    status, ad = http_json(a + "/v1/advertisement", token=TOKEN)
    assert status == 200 and ad["url"] == a and ad["model"] == NAME and list(ad["layers"]) == [0, 9] and ad["embed"]
    # a node fetched from the swarm hands out the manifest it was fetched with (token required too)
    assert http_json(a + "/v1/manifest")[0] == 401
    status, body = http_json(a + "/v1/manifest", token=TOKEN)
    assert status == 200 and manifest_digest(body["manifest"]) == swarm.model_id and body["torrent_hex"]
    # a node serving a local file has none: 404 no_manifest
    model = write_tiny_model(tiny_dir / "join-local.gguf", "llama", n_layers=2)
    config = NodeConfig(layers="0:2", model=str(model), embed=True, head=True, data_dir=str(tmp_path / "local"))
    with AppThread(lambda: make_node_app(config)) as local:
        status, body = http_json(local + "/v1/manifest")
        assert status == 404 and body["error"]["code"] == "no_manifest", body
        assert "local" in body["error"]["message"]

    # JoinLink: format/parse round trip, and what a bad link says
    full = JoinLink(
        NAME,
        swarm.model_id,
        dht=("127.0.0.1:6881", "[::1]:6882"),
        trackers=("http://t1:8470", "https://t2"),
        relays=("http://r:8470",),
        secret="s e&c=r/t",
        caches=("http://c:8475",),
    )
    assert JoinLink.parse(full.format()) == full
    assert JoinLink.parse(full.format()).caches == ("http://c:8475",)
    with pytest.raises(JoinLinkError, match="http"):
        JoinLink.parse(full.format() + "&cache=ftp://c")
    assert JoinLink.parse(full.format()).secret == "s e&c=r/t"
    assert JoinLink.parse(swarm.link.format()) == swarm.link
    assert JoinLink.parse(swarm.dht_link).dht == (swarm.contact,)
    assert "s e&c" not in repr(full)  # repr does not leak the secret
    good = swarm.link.format()
    query = good.split("?", 1)[1]
    bad = {
        "https://join?" + query: "starts with ggufswarm://join?",
        "ggufswarm://other?" + query: "starts with ggufswarm://join?",
        good.replace(f"&id={swarm.model_id}", ""): "no id=",
        good.replace(f"model={NAME}&", ""): "no model=",
        good.replace(swarm.model_id, "abc"): "64 digits",
        good + "&dht=127.0.0.1:notaport": "HOST:PORT",
        good + "&dht=127.0.0.1:70000": "HOST:PORT",
        good + "&dht=nohost": "HOST:PORT",
        good.replace("v=1", "v=2"): "version '2'",
        f"ggufswarm://join?v=1&model={NAME}&id={swarm.model_id}": "needs a DHT contact",
        good.replace("tracker=http", "tracker=ftp"): "http(s) URLs",
    }
    for text, message in bad.items():
        with pytest.raises(JoinLinkError, match=re.escape(message)):
            JoinLink.parse(text)
    assert issubclass(JoinLinkError, ValueError)


def test_cli_help_mentions_the_link(ggufswarm_cli):
    join = subprocess.run([*ggufswarm_cli, "join", "--help"], capture_output=True, text=True, timeout=60)
    assert join.returncode == 0, join.stderr
    assert "link" in join.stdout and "ggufswarm://join?" in join.stdout and "--reach" in join.stdout
    gw = subprocess.run([*ggufswarm_cli, "gateway", "--help"], capture_output=True, text=True, timeout=60)
    assert gw.returncode == 0 and "--join" in gw.stdout, gw.stderr


def test_cli_publish_prints_a_join_link(gemma_path, ggufswarm_cli, tmp_path):
    """``publish`` prints the link of what it published: its id is the digest of the manifest the tracker holds."""
    from apphost import AppThread

    with AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", token=TOKEN))) as tracker:
        pub = subprocess.run(
            [*ggufswarm_cli, "publish", str(gemma_path), "--tracker", tracker, "--name", "gemma-cli"]
            + ["--data-dir", str(tmp_path / "pub"), "--no-seed"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, **{TOKEN_ENV: TOKEN}),
        )
        assert pub.returncode == 0, pub.stderr
        [line] = [ln for ln in pub.stdout.splitlines() if ln.startswith("join link")]
        link = JoinLink.parse(line[line.index("ggufswarm://") :])
        assert (link.model, link.trackers, link.secret, link.dht) == ("gemma-cli", (tracker,), TOKEN, ())
        status, held = http_json(f"{tracker}/manifests/gemma-cli", token=TOKEN)
        assert status == 200 and manifest_digest(held["manifest"]) == link.model_id


def test_completions_continue_after_the_tracker_and_publisher_stop(swarm, gemma):
    want, _ = reference(gemma, PROMPT, MAX_TOKENS)
    swarm.stop_tracker_and_publisher()
    record = swarm.after_tracker
    print(f"\ncompletions after the tracker and publisher stopped: {[f'{s:.2f} s' for s in record['seconds']]}")
    assert record["seconds"][0] < AFTER_TRACKER_BOUND_S
    for body in record["bodies"]:
        assert body["choices"][0]["text"] == want
        assert route_urls(body) == record["route"]
    assert complete(swarm.gateway_url)["choices"][0]["text"] == want

    # the same plan straight from a new Directory (a gateway that joins now): its tracker refuses connections, the
    # DHT answers. Right after a node died (another test may have killed one) libtorrent's lookups in this 3-node
    # DHT can come back short until the announces of the live nodes, which wait out the dead node's 15 s rpc
    # timeout, are stored: within FRESH_PLAN_BOUND_S
    async def plan(directory: Directory) -> tuple[dict, float]:
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            while True:
                try:
                    return await directory.route(http, {"max_length": 64}), time.monotonic() - t0
                except TrackerError:
                    if time.monotonic() - t0 > FRESH_PLAN_BOUND_S:
                        raise
                    await asyncio.sleep(1.0)

    with dht_session(swarm.contact) as discovery:
        planned, seconds = asyncio.run(plan(Directory(NAME, [swarm.tracker_url], discovery, swarm.model_id, TOKEN)))
    print(f"Directory.route from the DHT (a fresh DHT session): {seconds:.2f} s")
    assert planned["source"] == "dht"
    assert [a["url"] for a in planned["route"]] == swarm.live
    assert [a["layers"] for a in planned["route"]] == [[0, 9], [9, 18]]
    assert planned["context"] > 0


def test_a_node_joins_without_tracker_and_replaces_a_killed_one(swarm, gemma, ggufswarm_cli):
    want, _ = reference(gemma, PROMPT, MAX_TOKENS)
    swarm.stop_tracker_and_publisher()
    a, b = swarm.nodes
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # the secret comes from the link alone
    env["PYTHONUNBUFFERED"] = "1"
    err_path = swarm.tmp / "c.err"
    with open(err_path, "w") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*ggufswarm_cli, "join", swarm.dht_link, "--layers", "9:18", "--threads", "1"]
            + ["--hop-timeout", HOP_TIMEOUT, "--data-dir", str(swarm.tmp / "c"), "--exit-with-parent"],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
    swarm.procs.append(proc)
    ready: list[str] = []

    def pump():
        ready.extend(ln for ln in proc.stdout if ln.startswith("ggufswarm node ready"))

    threading.Thread(target=pump, daemon=True).start()
    while not ready:
        assert proc.poll() is None, f"join exited {proc.returncode}:\n{tail(err_path)}"
        assert time.monotonic() - t0 < JOIN_READY_BOUND_S, f"not ready in {JOIN_READY_BOUND_S:g} s:\n{tail(err_path)}"
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    c_url = ready[0].split()[3]
    print(f"\njoin (tracker and publisher gone) -> ready: {seconds:.1f} s; {ready[0].strip()}")
    assert "layers 9:18 +head" in ready[0] and ready[0].rstrip().endswith("reach direct"), ready[0]
    assert c_url not in (a.url, b.url)
    [fetched] = [ln for ln in err_path.read_text().splitlines() if "fetched layers 9:18" in ln]
    print(fetched)
    got = re.search(r": (\d+) bytes in [\d.]+ s$", fetched)  # not "already on disk"
    assert got and int(got.group(1)) > 0, fetched

    wait_dht_lists(swarm.contact, swarm.model_id, {a.url, b.url, c_url})
    http_json(f"{swarm.gateway_url}/health", timeout=30)  # its DHT listing, reused for CACHE_S, now holds B too
    b.kill()  # SIGKILL: no goodbye; the DHT still holds its announce
    swarm.live = [a.url, c_url]
    # The gateway plans without the tracker now: the DHT, the nodes it listed before (directory.lookup's known
    # set: a lookup right after a node died can come back short) and their peers' hellos. The next completion
    # already routes A -> the new node: should its plan still take B from the listing just made, A refuses B
    # (next_hop_unknown: A's own listing no longer has it) and the gateway plans again without B.
    t0 = time.monotonic()
    status, out = http_json(
        f"{swarm.gateway_url}/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    )
    assert status == 200, out
    print(f"after SIGKILL of B: a completion through the new node in {time.monotonic() - t0:.1f} s")
    assert route_urls(out) == swarm.live, out["telemetry"]
    assert out["choices"][0]["text"] == want
    again = complete(swarm.gateway_url)
    assert route_urls(again) == swarm.live and again["choices"][0]["text"] == want
