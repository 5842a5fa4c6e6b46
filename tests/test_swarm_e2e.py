"""The whole story on loopback: tracker, publisher, nodes fetching their layers from the swarm, gateway via tracker."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
from apphost import AppThread

from ggufswarm.directory.trackers import TrackerClient
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.runtime.shard import ShardSpec
from ggufswarm.swarm.publish import publish
from ggufswarm.swarm.torrent import Swarm, save_path_for
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

PROMPT = "The capital of France is"


def complete(base: str, prompt: str, max_tokens: int = 12) -> dict:
    req = urllib.request.Request(
        f"{base}/v1/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_demo_whole_story_equals_generate(ggufswarm_cli):
    # the demo without its base-model repetition guard, greedy: generate's text (its other base-model default, no
    # media markers drawn, changes nothing here: this greedy answer holds none)
    demo = subprocess.run(
        [*ggufswarm_cli, "demo", PROMPT, "--raw", "--temperature", "0", "--max-tokens", "16", "--repeat-penalty", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "published" in demo.stderr and "from the swarm" in demo.stderr
    assert "ggufswarm demo: nodes 0:" in demo.stderr and "X-Ggufswarm-Token" in demo.stderr  # how to reach each node
    gen = subprocess.run(
        [*ggufswarm_cli, "generate", PROMPT, "--temperature", "0", "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    assert demo.stdout.strip() == gen.stdout.strip()


def test_demo_speculative_equals_generate(ggufswarm_cli):
    """``demo --speculative ngram`` (no swarm) streams the same greedy text as ``generate`` and reports its drafts;
    ``--speculative draft`` without a draft model is refused before anything starts."""
    prompt = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib2(n):\n"
    demo = subprocess.run(
        [
            *ggufswarm_cli,
            "demo",
            prompt,
            "--raw",
            "--no-swarm",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--speculative",
            "ngram",
            "--repeat-penalty",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "speculative ngram: drafted" in demo.stderr, demo.stderr[-3000:]
    gen = subprocess.run(
        [*ggufswarm_cli, "generate", prompt, "--temperature", "0", "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    assert demo.stdout.strip() == gen.stdout.strip()
    bad = subprocess.run(
        [*ggufswarm_cli, "demo", "hi", "--no-swarm", "--speculative", "draft"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--draft-model" in bad.stderr and "starting" not in bad.stderr, bad.stderr


def test_dead_node_expires_and_new_routes_avoid_it(gemma_path, tmp_path):
    with AppThread(lambda: make_tracker_app(TrackerConfig(db=str(tmp_path / "t.sqlite"), ttl_s=3.0))) as tracker:
        published = publish(gemma_path, tracker, "gemma")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([gemma_path]))
        specs = [ShardSpec(0, 9, embed=True), ShardSpec(9, 18, head=True), ShardSpec(9, 18, head=True)]
        nodes, gateway = [], None
        try:
            nodes = start_nodes(
                specs,
                "gemma",
                threads=1,
                timeout=600,
                extra=["--tracker", tracker, "--hop-timeout", "10"],
                per_node=lambda i: ["--data-dir", str(tmp_path / f"node{i}")],
            )
            deadline = time.monotonic() + 30
            while len(TrackerClient(tracker).nodes("gemma")) < 3:
                assert time.monotonic() < deadline, "nodes did not advertise"
                time.sleep(0.2)
            # the second range was fetched, not copied: on disk, the bytes the manifest gives its layers and head (the
            # header included), plus at most the rest of a piece at each end of each range (the swarm moves whole
            # pieces). llama.cpp reads the layers from those very bytes (patch 0004): the node's shard file under
            # shards/ is a header (metadata and tokenizer), so the whole data dir holds one copy of the layers
            manifest = published.manifest
            ranges = manifest.byte_ranges(9, 18, head=True)
            needed = sum(end - begin for _, begin, end in ranges)
            assert needed >= manifest.files[0]["header_bytes"] + sum(manifest.layer_bytes()[9:18])
            files = {
                f: f.stat().st_blocks * 512 for f in (tmp_path / "node1").rglob("*.gguf") if "shards" not in f.parts
            }
            assert needed <= sum(files.values()) <= needed + 2 * len(ranges) * manifest.piece_size, (
                files,
                needed,
                len(ranges),
                manifest.piece_size,
            )
            everything = sum(f.stat().st_blocks * 512 for f in (tmp_path / "node1").rglob("*") if f.is_file())
            shard_headers = [f for f in (tmp_path / "node1" / "shards").iterdir() if f.name.endswith("-header.gguf")]
            assert len(shard_headers) == 1 and shard_headers[0].stat().st_size < 2 * manifest.files[0]["header_bytes"]
            assert everything <= 1.05 * needed + shard_headers[0].stat().st_size, (everything, needed)
            gateway = ServerThread(
                make_app(
                    GatewayConfig([], model="gemma", tracker=tracker, data_dir=str(tmp_path / "gw"), hop_timeout_s=10)
                )
            )
            base = gateway.start()
            first = complete(base, PROMPT)
            used = {hop["node"] for hop in first["telemetry"]["route"]}
            victim = next(n for n in nodes[1:] if n.url in used)
            victim.kill()  # no deregistration: the tracker must notice by TTL (3 s; the deadline only bounds it)
            deadline = time.monotonic() + 30
            while victim.url in {a["url"] for a in TrackerClient(tracker).nodes("gemma")}:
                assert time.monotonic() < deadline, "the dead node never expired"
                time.sleep(0.2)
            for _ in range(3):
                out = complete(base, PROMPT)
                assert victim.url not in {hop["node"] for hop in out["telemetry"]["route"]}
                assert out["choices"][0]["text"] == first["choices"][0]["text"]
        finally:
            if gateway is not None:
                gateway.stop()
            stop_nodes(nodes)
            seeder.close()


def test_node_started_before_its_tracker_and_model_waits_then_serves(tmp_path, tiny_dir):
    """Start order does not matter: a node started before the tracker is up, and before its model is
    published, says what it waits for (one line each) and serves once both exist."""
    import socket
    import sys
    import threading

    from tinymodels import write_tiny_model

    from ggufswarm.node.launch import node_command

    model = write_tiny_model(tiny_dir / "late.gguf", "llama", n_layers=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tracker_url = f"http://127.0.0.1:{port}"
    cmd = node_command(
        ShardSpec(0, 2, embed=True, head=True),
        "late",
        extra=["--tracker", tracker_url, "--data-dir", str(tmp_path / "node")],
    )
    proc = subprocess.Popen([sys.executable, *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    seeder = None
    try:
        deadline = time.monotonic() + 30
        while not any("waiting for the tracker" in ln for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            time.sleep(0.2)
        assert proc.poll() is None, lines  # it waits, it does not exit
        tracker = ServerThread(make_tracker_app(TrackerConfig(db=":memory:")), port=port)
        tracker.start()
        try:
            deadline = time.monotonic() + 30
            while not any("to be published" in ln for ln in lines):
                assert time.monotonic() < deadline and proc.poll() is None, lines
                time.sleep(0.2)
            published = publish(model, tracker_url, "late", tmp_path / "publisher")
            seeder = Swarm()
            seeder.seed(published.torrent, save_path_for([model]))
            ready = proc.stdout.readline()
            assert ready.startswith("ggufswarm node ready:"), (ready, lines)
        finally:
            tracker.stop()
    finally:
        proc.terminate()
        proc.wait(30)
        if seeder is not None:
            seeder.close()


def test_a_gateway_without_model_serves_every_model_of_the_swarm(tmp_path, tiny_dir):
    """``gateway --tracker`` without ``--model``: /v1/models lists every model the swarm can serve end to end,
    each request's ``model`` picks one (its vocabulary fetched on first use), each answer equals that model's
    own node run alone; a model the swarm has not published is 404 model_not_found, none at all a 400."""
    from tinymodels import write_tiny_model

    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.client.route import Hop, RemoteRoute
    from ggufswarm.client.tokenizer import Tokenizer
    from ggufswarm.runtime.sampling import SamplingParams

    models = {
        "tiny-a": write_tiny_model(tiny_dir / "every-a.gguf", "llama", n_layers=2, seed=1),
        "tiny-b": write_tiny_model(tiny_dir / "every-b.gguf", "llama", n_layers=2, seed=2, context_length=2048),
    }
    with AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", ttl_s=6))) as tracker:
        seeder = Swarm()
        nodes = []
        try:
            for name, path in models.items():
                seeder.seed(publish(path, tracker, name, tmp_path / f"pub-{name}").torrent, save_path_for([path]))
                nodes += start_nodes(
                    [ShardSpec(0, 2, embed=True, head=True)],
                    name,
                    extra=["--tracker", tracker],
                    per_node=lambda _, name=name: ["--data-dir", str(tmp_path / f"node-{name}")],
                )
            gateway = ServerThread(make_app(GatewayConfig([], tracker=tracker, data_dir=str(tmp_path / "gateway"))))
            base = gateway.start()
            try:
                deadline = time.monotonic() + 30
                while True:
                    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
                        listed = sorted(m["id"] for m in json.loads(r.read())["data"])
                    if listed == sorted(models) or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                assert listed == sorted(models)
                for (name, path), node in zip(models.items(), nodes):
                    req = urllib.request.Request(
                        f"{base}/v1/completions",
                        method="POST",
                        headers={"Content-Type": "application/json"},
                        data=json.dumps({"model": name, "prompt": "a b c", "max_tokens": 5, "temperature": 0}).encode(),
                    )
                    with urllib.request.urlopen(req, timeout=120) as r:
                        body = json.loads(r.read())
                    assert body["model"] == name and [h["node"] for h in body["telemetry"]["route"]] == [node.url]
                    # the route was built from the tracker's advertisement: the same hop as the node's /health says
                    [ad] = TrackerClient(tracker).nodes(name)
                    assert Hop.from_advertisement(ad) == RemoteRoute([node.url]).hops[0]
                    # the same prompt straight through that model's node, tokenized with that model's vocabulary
                    tok = Tokenizer(str(path), GGUFModelFile(path).metadata)
                    prompt = tok.encode("a b c", special=True)
                    session = RemoteRoute([node.url]).open(64, SamplingParams(temperature=0))
                    try:
                        want = [session.step(prompt)]
                        for _ in range(body["usage"]["completion_tokens"] - 1):
                            want.append(session.step([want[-1]]))
                    finally:
                        session.close()
                    assert body["usage"]["prompt_tokens"] == len(prompt)
                    assert body["choices"][0]["text"] == tok.decode(want)
                for extra, status in (({"model": "nope"}, 404), ({}, 400)):
                    req = urllib.request.Request(
                        f"{base}/v1/completions",
                        method="POST",
                        headers={"Content-Type": "application/json"},
                        data=json.dumps({"prompt": "a", "max_tokens": 1, **extra}).encode(),
                    )
                    with pytest.raises(urllib.error.HTTPError) as err:
                        urllib.request.urlopen(req, timeout=60)
                    assert err.value.code == status
                    assert json.loads(err.value.read())["error"]["param"] == "model"
                # a prompt longer than any session of tiny-b's nodes (its context: 2048) is the request's fault:
                # 400 context_length_exceeded, not the 503 no_route a client would retry
                req = urllib.request.Request(
                    f"{base}/v1/completions",
                    method="POST",
                    headers={"Content-Type": "application/json"},
                    data=json.dumps({"model": "tiny-b", "prompt": "a b " * 1500, "max_tokens": 4}).encode(),
                )
                with pytest.raises(urllib.error.HTTPError) as err:
                    urllib.request.urlopen(req, timeout=60)
                error = json.loads(err.value.read())["error"]
                assert (err.value.code, error["code"]) == (400, "context_length_exceeded"), error
                assert "2048" in error["message"]
            finally:
                gateway.stop()
        finally:
            stop_nodes(nodes)
            seeder.close()
