"""The swarm token: every route of a node, of the tracker and of the snapshot cache answers 401 without it.

The routes are enumerated from the apps themselves, so a new endpoint cannot slip by.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from identities import signed_ad
from tinymodels import write_tiny_model

from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.net.auth import TOKEN_HEADER
from ggufswarm.net.http import ServerThread
from ggufswarm.net.reach import PUBLIC_PATHS
from ggufswarm.node.app import make_app as make_node_app
from ggufswarm.node.state import NodeConfig
from ggufswarm.tracker.app import TrackerConfig
from ggufswarm.tracker.app import make_app as make_tracker_app

TOKEN = "s3cret-swarm-token"


def status_of(url: str, method: str, headers: dict) -> int:
    data = b"{}" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def concrete(path: str) -> str:
    return (
        path.replace("{sid}", "00000000-0000-0000-0000-000000000000")
        .replace("{name}", "x")
        .replace("{node_id}", "x")
        .replace("{key}", "0" * 64)
    )


@pytest.fixture(scope="module")
def apps(tiny_dir, tmp_path_factory):
    model = write_tiny_model(tiny_dir / "auth.gguf", "llama", n_layers=2)
    node = make_node_app(NodeConfig(layers="0:2", embed=True, head=True, model=str(model), token=TOKEN))
    tracker = make_tracker_app(TrackerConfig(db=":memory:", token=TOKEN))
    cache = make_cache_app(CacheConfig(dir=str(tmp_path_factory.mktemp("cache")), max_bytes=2**20, token=TOKEN))
    servers = [ServerThread(node), ServerThread(tracker), ServerThread(cache)]
    urls = [s.start() for s in servers]
    yield list(zip((node, tracker, cache), urls))
    for s in servers:
        s.stop()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["node", "tracker", "cache"])
def test_every_route_needs_the_token(apps, which):
    app, url = apps[which]
    routes = [(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"]
    assert len(routes) >= 5
    for method, path in routes:
        if path in PUBLIC_PATHS:  # a dial-back's probe: answered to anyone, says nothing but "ok"
            assert status_of(url + concrete(path), method, {}) == 200, (method, path)
            continue
        assert status_of(url + concrete(path), method, {}) == 401, (method, path)
        assert status_of(url + concrete(path), method, {TOKEN_HEADER: "wrong"}) == 401, (method, path)
        assert status_of(url + concrete(path), method, {TOKEN_HEADER: TOKEN}) != 401, (method, path)


def test_health_with_token(apps):
    _, url = apps[0]
    assert status_of(url + "/health", "GET", {TOKEN_HEADER: TOKEN}) == 200
    assert status_of(url + "/health?token=" + TOKEN, "GET", {}) == 200  # query form, for BitTorrent announces


def test_the_token_is_never_in_a_torrent(apps, tmp_path):
    """A published torrent announces with a key derived from the token (it opens /announce only), so the
    token is not in the .torrent, the manifest the tracker serves, or the tracker's database."""
    import libtorrent as lt

    from ggufswarm.directory.trackers import TrackerClient
    from ggufswarm.net.auth import announce_key
    from ggufswarm.swarm.publish import publish

    _, tracker = apps[1]
    model = write_tiny_model(tmp_path / "published.gguf", "llama", n_layers=2)
    published = publish(model, tracker, "tiny", token=TOKEN)
    served = TrackerClient(tracker, TOKEN).manifest("tiny")
    for blob in (published.torrent, bytes.fromhex(served["torrent_hex"]), json.dumps(served).encode()):
        assert TOKEN.encode() not in blob
    announce = lt.bdecode(published.torrent)[b"announce"].decode()
    assert announce.endswith("/announce?swarm_key=" + announce_key(TOKEN))
    assert status_of(announce + "&info_hash=" + "%00" * 20 + "&peer_id=x&port=1", "GET", {}) == 200
    assert status_of(tracker + "/status.json?swarm_key=" + announce_key(TOKEN), "GET", {}) == 401  # announce only


def test_the_token_is_not_in_the_tracker_database(tmp_path):
    """A tracker keeping its registry in a file: after a publish, an announce and a node's heartbeat, the token is
    in none of the database's files (the database, its WAL), in clear or as the hex of its bytes."""
    from ggufswarm.directory.trackers import TrackerClient
    from ggufswarm.net.auth import announce_key
    from ggufswarm.swarm.publish import publish

    db = tmp_path / "tracker.db"
    server = ServerThread(make_tracker_app(TrackerConfig(db=str(db), token=TOKEN)))
    tracker = server.start()
    try:
        model = write_tiny_model(tmp_path / "published.gguf", "llama", n_layers=2)
        publish(model, tracker, "tiny", token=TOKEN)
        announce = f"{tracker}/announce?swarm_key={announce_key(TOKEN)}&info_hash={'%00' * 20}&peer_id=x&port=1"
        assert status_of(announce, "GET", {}) == 200
        ad = {
            "node_id": "n1",
            "url": "http://127.0.0.1:9",
            "model": "tiny",
            "layers": [0, 2],
            "embed": True,
            "head": True,
            "state": "ready",
            "free_kv_tokens": 64,
            "decode_ms": 1.0,
        }
        TrackerClient(tracker, TOKEN).call("nodes/heartbeat", "POST", signed_ad(ad))
        assert [a["url"] for a in TrackerClient(tracker, TOKEN).nodes("tiny")] == [ad["url"]]
        files = sorted(tmp_path.glob("tracker.db*"))
        stored = b"".join(f.read_bytes() for f in files)
        assert db in files and stored
        assert TOKEN.encode() not in stored and TOKEN.encode().hex().encode() not in stored
    finally:
        server.stop()


def test_the_library_never_reads_the_environment(apps, monkeypatch):
    """Only the command line reads ``$GGUFSWARM_TOKEN``: an in-process client or config given no token sends
    none (401 from a private swarm) even with the variable set, and one given the token gets through."""
    from ggufswarm.client.route import RemoteRoute
    from ggufswarm.directory.trackers import TrackerClient, TrackerError
    from ggufswarm.net.auth import TOKEN_ENV
    from ggufswarm.protocol.errors import RouteError

    (_, node), (_, tracker) = apps[0], apps[1]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(RouteError) as refused:
        RemoteRoute([node], hop_timeout_s=10.0)
    assert refused.value.status == 401 and refused.value.hop == node
    with pytest.raises(TrackerError) as denied:
        TrackerClient(tracker).models()
    assert denied.value.status == 401
    assert NodeConfig(layers="0:2").token is None and TrackerConfig().token is None
    assert CacheConfig(dir="x").token is None

    route = RemoteRoute([node], hop_timeout_s=10.0, token=TOKEN)
    session = route.open(8)
    try:
        assert isinstance(session.step([1, 2, 3]), int)
    finally:
        session.close()
    assert isinstance(TrackerClient(tracker, TOKEN).models(), list)


def test_cli_token_from_flag_or_environment(ggufswarm_cli, tmp_path):
    """The command line is where the token comes from: ``--token``, else ``$GGUFSWARM_TOKEN`` (the flag wins);
    servers require it and clients (``ggufswarm status``) send it."""
    import os
    import signal
    import subprocess

    from ggufswarm.net.auth import TOKEN_ENV

    def serve(*args, env_token=None):
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        if env_token:
            env[TOKEN_ENV] = env_token
        proc = subprocess.Popen(
            [*ggufswarm_cli, "tracker", "--port", "0", "--db", ":memory:", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = proc.stdout.readline()
        assert line.startswith("ggufswarm tracker ready: http://"), line + proc.stderr.read()
        return proc, line.split()[3]

    def status(url, *args, env_token=None):
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if env_token:
            env[TOKEN_ENV] = env_token
        return subprocess.run(
            [*ggufswarm_cli, "status", "--tracker", url, *args], capture_output=True, text=True, env=env, timeout=60
        )

    for args, env_token, good, bad in (
        (["--token", "from-flag"], "from-env", "from-flag", "from-env"),
        ([], "from-env", "from-env", "from-flag"),
    ):
        proc, url = serve(*args, env_token=env_token)
        try:
            assert status_of(url + "/models", "GET", {}) == 401
            assert status_of(url + "/models", "GET", {TOKEN_HEADER: bad}) == 401
            assert status_of(url + "/models", "GET", {TOKEN_HEADER: good}) == 200
            assert status(url, env_token=good).returncode == 0
            assert status(url, "--token", good, env_token=bad).returncode == 0  # the flag wins
            refused = status(url, "--token", bad, env_token=good)
            assert refused.returncode == 1 and "401" in refused.stderr, refused.stderr
            assert status(url).returncode == 1
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
