"""A swarm across home NATs, in the namespace test internet (tests/netlab.py): one node behind a UPnP router, one
behind a strict NAT reached through a relay, one public; repair after SIGKILL; the tracker killed; no packet leaks.

The swarm (module fixture): on ``pub`` a tracker, a publisher seeding the embedded Gemma, node P (layers 0:6 +embed,
``--relay``, the DHT's first contact) and a gateway started with the join link; in home A node A (``join``, layers
6:12: reachable through a port its router mapped by UPnP / NAT-PMP); in home B node B (``join``, layers 12:18 +head:
reached through P's relay). Every text is compared with llama.cpp's own full-model greedy run (``reference``),
which a loopback route equals bitwise (tests/test_node.py and others).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from natswarm import CLI, CLIENT, PUB, PY, Proc, node_ready, start_published
from netlab import NetLab, netlab_available
from route_fixtures import reference

from ggufswarm.net.invite import JoinLink

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

TOKEN = "nat-test-token"
PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern and a "
    "notebook in which he wrote down the ships he saw. One stormy night in October,"
)
LONG = 160  # tokens of the streams that see a node die or the tracker go away mid-stream
JOIN_BOUND_S = 120.0  # join (tracker dead) to ready: DHT lookup, manifest from a peer, fetch 6:12 from home A, load
DHT_ROUTE_BOUND_S = 30.0  # a node ready → the gateway routes through it, planned from the DHT (no tracker)


@pytest.fixture(scope="module")
def swarm(gemma_path, tmp_path_factory):
    reason = netlab_available()
    if reason:
        pytest.fail(f"the namespace test internet is not available here: {reason}")
    tmp = tmp_path_factory.mktemp("nat")
    lab = NetLab()
    procs: dict[str, Proc] = {}

    def start(name, role, argv):
        procs[name] = Proc(lab, role, argv, name, tmp, TOKEN)
        return procs[name]

    try:
        link = start_published(start, tmp, gemma_path, TOKEN, 8470, 8471)
        common = ["--threads", "1", "--host", "0.0.0.0"]
        p = start(
            "P",
            "pub",
            CLI
            + ["node", "--join", link, "--dht", "-", "--torrent-port", "6881", "--port", "8471", "--relay"]
            + ["--public-host", PUB, "--layers", "0:6", "--embed", "--data-dir", str(tmp / "P")]
            + common,
        )
        node_ready(p)
        a = start("A", "hA", CLI + ["join", link, "--layers", "6:12", "--data-dir", str(tmp / "A")] + common)
        b = start("B", "hB", CLI + ["join", link, "--layers", "12:18", "--head", "--data-dir", str(tmp / "B")] + common)
        urls = {"P": f"http://{PUB}:8471"}
        for name, proc in (("A", a), ("B", b)):
            urls[name], path = node_ready(proc)
            urls[name + "_path"] = path
        g = start(
            "gateway",
            "pub",
            CLI + ["gateway", "--join", link, "--host", PUB, "--port", "8000", "--data-dir", str(tmp / "gw")],
        )
        g.wait_for(r"ggufswarm gateway ready", 120)
        yield {"lab": lab, "procs": procs, "start": start, "link": link, "urls": urls, "tmp": tmp}
    finally:
        for proc in procs.values():
            proc.kill()
        lab.close()


def stream(lab: NetLab, max_tokens: int, on_delta=None) -> dict:
    """A streamed greedy completion through the gateway, from a client on pub; ``on_delta(n)`` after each delta."""
    client = lab.popen("pub", [PY, CLIENT, f"http://{PUB}:8000", PROMPT, str(max_tokens)], stdout=-1, text=True)
    final = None
    for line in client.stdout:
        event = json.loads(line)
        if "delta" in event and on_delta is not None:
            on_delta(event["n"])
        elif "text" in event or "error" in event:
            final = event
    client.wait(60)
    assert final is not None and "error" not in final, final
    return final


def sessions_on(lab: NetLab, url: str) -> int:
    """Sessions node ``url`` holds now (its /health, asked from pub)."""
    code = (
        "import json, sys, urllib.request as u; r = u.Request(sys.argv[1] + '/health', "
        "headers={'X-Ggufswarm-Token': sys.argv[2]}); print(json.load(u.urlopen(r, timeout=10))['sessions'])"
    )
    return int(lab.run("pub", [PY, "-c", code, url, TOKEN], timeout=30).stdout.strip())


def gateway_get(lab: NetLab, path: str) -> dict:
    """The gateway's JSON answer to ``GET path`` (any status), asked from pub."""
    code = (
        "import json, sys, urllib.request as u, urllib.error as e\n"
        "try:\n    r = u.urlopen(sys.argv[1], timeout=30)\nexcept e.HTTPError as err:\n    r = err\n"
        "print(r.read().decode())"
    )
    return json.loads(lab.run("pub", [PY, "-c", code, f"http://{PUB}:8000{path}"], timeout=60).stdout)


def hop_urls(telemetry: dict) -> list[str]:
    return [h["node"] for h in telemetry["route"]]


def test_swarm_across_nats(swarm, gemma):
    """The whole story, in order (each step needs the previous one; one swarm, started once):

    1. home A's node is reached through the port its router mapped (UPnP / NAT-PMP), home B's through the relay on
       P; a streamed greedy answer equals llama.cpp's; telemetry names each hop's path;
    2. a spare of home B's layers joins in home B (relayed too); the one of the two the stream runs on is SIGKILLed
       mid-stream: the route is repaired onto the other (relayed) one, the text equal;
    3. the tracker and the publisher are killed mid-stream: the stream completes identically;
    4. a new node joins with the link (no tracker): the manifest from a peer, its layers (6:12) from home A's node
       behind the UPnP NAT, within JOIN_BOUND_S; home A's node is killed: the gateway plans through the new node
       from the DHT within DHT_ROUTE_BOUND_S, the text equal;
    5. no namespace sent a packet to an address outside the test nets.
    """
    lab, procs, start, tmp, urls = swarm["lab"], swarm["procs"], swarm["start"], swarm["tmp"], swarm["urls"]
    node_args = ["--threads", "1", "--host", "0.0.0.0", "--public-host", PUB]
    home_args = ["--threads", "1", "--host", "0.0.0.0"]

    # 1
    assert urls["A_path"] == "mapped" and urls["A"].startswith("http://10.77.0.2:"), urls
    assert urls["B_path"] == "relayed" and urls["B"].startswith(f"http://{PUB}:"), urls
    out = stream(lab, 24)
    assert out["text"] == reference(gemma, PROMPT, 24)[0]
    tel = out["telemetry"]
    assert hop_urls(tel) == [urls["P"], urls["A"], urls["B"]]
    assert [h["path"] for h in tel["hops"]] == ["direct", "mapped", "relayed"]

    # 2
    expected = reference(gemma, PROMPT, LONG)[0]
    # the spare joins home B as well (relayed too): the route takes B or S (the planner prefers the shard that looks
    # faster), and whichever the session is on at the first token is killed, so a relayed node dies every run
    spare = start(
        "S", "hB", [*CLI, "join", swarm["link"], "--layers", "12:18", "--head", "--data-dir", f"{tmp}/S", *home_args]
    )
    urls["S"], s_path = node_ready(spare)
    assert s_path == "relayed" and urls["S"].startswith(f"http://{PUB}:"), urls
    killed = {}

    def kill_holder(n):
        if n == 1 and not killed:
            held = {name: sessions_on(lab, urls[name]) for name in ("B", "S")}
            victim = max(held, key=held.get)
            assert held[victim] > 0, held  # the session is on one of them
            procs[victim].kill()
            killed["victim"] = victim

    out = stream(lab, LONG, kill_holder)
    assert out["text"] == expected
    assert killed, "the stream ended before its first delta"
    survivor = "S" if killed["victim"] == "B" else "B"
    assert out["telemetry"]["repairs"], out["telemetry"]
    assert hop_urls(out["telemetry"])[-1] == urls[survivor], out["telemetry"]["route"]
    assert out["telemetry"]["hops"][-1]["path"] == "relayed", out["telemetry"]["hops"]

    # 3
    def kill_tracker(n):
        if n == 5:
            procs["tracker"].kill()
            procs["publisher"].kill()

    assert stream(lab, LONG, kill_tracker)["text"] == expected
    health = gateway_get(lab, "/health")  # the tracker is gone: the gateway says it serves through the DHT
    assert health["status"] == "ok" and health["tracker"]["ok"] is False and health["dht"] == {"ok": True}, health
    assert [m["id"] for m in gateway_get(lab, "/v1/models")["data"]] == [JoinLink.parse(swarm["link"]).model]

    # 4
    t0 = time.monotonic()
    j = start("J", "pub", CLI + ["join", swarm["link"], "--layers", "6:12", "--data-dir", str(tmp / "J")] + node_args)
    urls["J"], _ = node_ready(j, JOIN_BOUND_S)
    join_s = time.monotonic() - t0
    fetched = re.search(r"fetched layers 6:12 of \S+: (\d+) bytes", j.stderr())
    assert fetched and int(fetched.group(1)) > 0, j.stderr()
    procs["A"].kill()
    t0 = time.monotonic()
    while True:
        try:
            out = stream(lab, 24)
            break
        except AssertionError as exc:
            print(f"  {time.monotonic() - t0:5.1f} s: {str(exc)[:300]}")
            if time.monotonic() - t0 > DHT_ROUTE_BOUND_S:
                raise
            time.sleep(1.0)
    routed_s = time.monotonic() - t0
    print(f"\njoin (tracker dead) to ready: {join_s:.1f} s; DHT route after home A's node died: {routed_s:.1f} s")
    assert out["text"] == reference(gemma, PROMPT, 24)[0]
    assert hop_urls(out["telemetry"]) == [urls["P"], urls["J"], urls[survivor]]

    # 5
    assert lab.escaped_packets() == dict.fromkeys(lab.ns, 0)
