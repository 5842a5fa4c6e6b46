"""Issue 26: the gateway's shadow-replay verifier (gateway/verify.py, gateway/shadow.py).

Fast tests judge synthetic signed commitments. The slow ones run one module-scoped swarm on loopback: a tracker, a
publisher seeding Gemma 3 270M, node P (0:6 +embed), two honest nodes H1, H2 and a liar L (``--test-lie noise``) for
6:12, a head (12:18), and an in-process gateway with ``--verify-rate 1`` (every session through every hop audited).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest
from apphost import AppThread

from ggufswarm.client.route import Hop
from ggufswarm.client.telemetry import RouteTelemetry
from ggufswarm.client.transport import BANNED
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.gateway.app import GATEWAY
from ggufswarm.gateway.shadow import (
    Recording,
    Replayed,
    SentFrame,
    Unverifiable,
    check_recording,
    compare,
)
from ggufswarm.gateway.verify import Verifier, Watch, _agrees, check_rate, sessions_to_catch
from ggufswarm.net.commitments import check_ban_evidence, served_context, serves_context, signed_body
from ggufswarm.net.identity import NodeIdentity, canonical
from ggufswarm.runtime.sampling import SamplingParams

# -- fast: the bound, the comparison of signed commitments, a ban's consequences ----------------------------------


def test_sessions_to_catch_is_the_stated_bound():
    assert sessions_to_catch(0.02) == 684  # ceil(ln(1e-6) / ln(0.98))
    assert sessions_to_catch(0.1) == 132
    assert sessions_to_catch(1) == 1 and sessions_to_catch(0) is None
    for rate in (0.02, 0.1, 0.3):
        n = sessions_to_catch(rate)
        assert (1 - rate) ** n <= 1e-6 < (1 - rate) ** (n - 1)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            check_rate(bad)


IDS = [NodeIdentity.generate() for _ in range(4)]  # P, the audited node, a shadow, a head


def hop(url: str, start: int, end: int, ident: NodeIdentity, embed=False, head=False) -> Hop:
    return Hop(url, start, end, embed, head, 640, 18, 1024, 512, node_id=ident.key_id)


HOPS = [
    hop("http://p", 0, 6, IDS[0], embed=True),
    hop("http://a", 6, 12, IDS[1]),
    hop("http://h", 12, 18, IDS[3], head=True),
]


def commit(ident: NodeIdentity, sid: str, step: int, start: int, n: int, inp: str, out: str) -> dict:
    c = {"in": inp, "out": out, "key": ident.key_id, "mode": 0, "ctx": "c" * 32, "prev": f"p{step}"}
    return {**c, "sig": ident.sign(canonical(signed_body(sid, step, start, n, c)))}


def run_of(sid: str, idents, outs_per_frame, frames) -> list[list[dict]]:
    """Per frame, the hops' commitments of a chain whose hop j outputs ``outs[j]`` (and takes hop j-1's output)."""
    out = []
    for frame, outs in zip(frames, outs_per_frame):
        ins = [f"ids{frame.step}"] + outs[:-1]
        out.append(
            [
                commit(ident, sid, frame.step, frame.start, len(frame.ids), i, o)
                for ident, i, o in zip(idents, ins, outs)
            ]
        )
    return out


FRAMES = [
    SentFrame(1, 0, (2, 3, 4), True, False),
    SentFrame(2, 3, (5,), True, False),
    SentFrame(3, 4, (6,), True, False),
]
HONEST = [["a1", "b1", "c1"], ["a2", "b2", "c2"], ["a3", "b3", "c3"]]


def recording(outs) -> Recording:
    sid = str(uuid.uuid4())
    commits = run_of(sid, [IDS[0], IDS[1], IDS[3]], outs, FRAMES)
    return Recording(sid, HOPS, FRAMES, commits, [], [], SamplingParams(temperature=0), 64, "f32", 0, False)


def shadow_run(outs, steps=(1, 2, 3), ident=IDS[2]) -> Replayed:
    sid = str(uuid.uuid4())
    frames = [SentFrame(s, f.start, f.ids, f.sample, f.verify) for s, f in zip(steps, FRAMES)]
    return Replayed(sid, list(steps), run_of(sid, [IDS[0], ident, IDS[3]], outs, frames))


def test_compare_finds_the_first_step_the_audited_hop_differs_with_equal_inputs():
    rec = recording(HONEST)
    assert compare(rec, shadow_run(HONEST), 1, IDS[1].key_id, IDS[2].key_id).result == "match"
    lied = [HONEST[0], ["a2", "LIE", "x2"], ["a3", "LIE3", "x3"]]
    verdict = compare(recording(lied), shadow_run(HONEST), 1, IDS[1].key_id, IDS[2].key_id)
    assert (verdict.result, verdict.frame, verdict.compared) == ("mismatch", 1, 2)
    assert verdict.real["out"] == "LIE" and verdict.other["out"] == "b2" and verdict.real["in"] == verdict.other["in"]
    assert verdict.real["key"] == IDS[1].key_id and verdict.other["key"] == IDS[2].key_id
    assert verdict.real["step"] == 2 and verdict.real["sid"] != verdict.other["sid"]  # each verifiable on its own
    # a replay whose later replies never came back is compared as far as it goes
    short = shadow_run(HONEST)
    short.commits[2] = None
    assert compare(rec, short, 1, IDS[1].key_id, IDS[2].key_id).compared == 2
    # hop 2 differing after an equal hop 1 is not the audited hop's doing
    assert (
        compare(rec, shadow_run([HONEST[0], ["a2", "b2", "zz"], HONEST[2]]), 1, IDS[1].key_id, None).result == "match"
    )


def test_compare_cannot_conclude_on_bad_or_foreign_commitments():
    rec = recording(HONEST)
    forged = recording(HONEST)
    forged.commits[0][1] = dict(forged.commits[0][1], out="b1-altered")  # the signature no longer covers it
    with pytest.raises(Unverifiable, match="does not verify"):
        compare(forged, shadow_run(HONEST), 1, IDS[1].key_id, IDS[2].key_id)
    with pytest.raises(Unverifiable, match="does not verify"):  # found before any replay
        check_recording(forged, 1, IDS[1].key_id)
    check_recording(rec, 1, IDS[1].key_id)
    with pytest.raises(Unverifiable, match="names key"):  # the hop's commitment is another node's
        compare(rec, shadow_run(HONEST), 1, IDS[2].key_id, IDS[2].key_id)
    with pytest.raises(Unverifiable, match="not audited"):  # hop 0, the same node in both runs, answered otherwise
        compare(rec, shadow_run([["zz", "b1", "c1"], *HONEST[1:]]), 1, IDS[1].key_id, IDS[2].key_id)
    with pytest.raises(Unverifiable, match="no commitment"):
        missing = recording(HONEST)
        missing.commits[0][1] = None
        compare(missing, shadow_run(HONEST), 1, IDS[1].key_id, IDS[2].key_id)
    nothing = shadow_run(HONEST)
    nothing.commits = [None, None, None]
    with pytest.raises(Unverifiable, match="no commitment to compare"):
        compare(rec, nothing, 1, IDS[1].key_id, IDS[2].key_id)


def test_a_third_node_confirms_only_when_it_sides_with_the_shadow():
    lied = recording([HONEST[0], ["a2", "LIE", "x2"], HONEST[2]])
    first = compare(lied, shadow_run(HONEST), 1, IDS[1].key_id, IDS[2].key_id)
    third = IDS[0]  # any key: the third run is signed by it
    assert _agrees(compare(lied, shadow_run(HONEST, ident=third), 1, IDS[1].key_id, third.key_id), first) == "shadow"
    same_as_audited = shadow_run([HONEST[0], ["a2", "LIE", "x2"], HONEST[2]], ident=third)
    assert _agrees(compare(lied, same_as_audited, 1, IDS[1].key_id, third.key_id), first) == "audited"
    other = shadow_run([HONEST[0], ["a2", "OTHER", "x2"], HONEST[2]], ident=third)
    assert _agrees(compare(lied, other, 1, IDS[1].key_id, third.key_id), first) == "neither"


class FakeSession:
    """What the verifier touches of an AsyncRouteSession."""

    def __init__(self, hops):
        self.route = type("R", (), {"hops": hops})()
        self.measured = RouteTelemetry()
        self.failed = []
        self.sent = None

    def fail(self, exc):
        self.failed.append(exc)


class FakeDirectory:
    def __init__(self):
        self.banned = set()

    def ban(self, key):
        self.banned.add(key)


def test_a_ban_repairs_live_sessions_and_taints_answers():
    async def scenario():
        v = Verifier(1.0)
        planner = type("P", (), {"directory": FakeDirectory()})()
        v.attach(planner)
        gw = object()
        done = v.watch(FakeSession(HOPS), "cmpl-done")
        done.audited = []  # nothing to replay here
        v.finish(done, gw)
        live = v.watch(FakeSession(HOPS), "cmpl-live")
        elsewhere = v.watch(FakeSession([HOPS[0], hop("http://b", 6, 12, IDS[2]), HOPS[2]]), "cmpl-other")
        await v.ban(None, IDS[1].key_id, "http://a", "lied", {"kind": "test"})
        assert planner.directory.banned == {IDS[1].key_id}
        assert [e.code for e in live.session.failed] == [BANNED] and live.session.failed[0].hop == "http://a"
        assert not elsewhere.session.failed and not elsewhere.tainted
        assert v.telemetry(live) == {"tainted_by": [IDS[1].key_id]} and v.telemetry(elsewhere) == {}
        live.audited = elsewhere.audited = []
        v.finish(live, gw)
        v.finish(elsewhere, gw)
        view = v.view()
        assert view["banned"] == [IDS[1].key_id] and view["tainted"] == ["cmpl-done", "cmpl-live"]
        assert view["bans"][0]["evidence"] == {"kind": "test"} and v.banned_urls() == {"http://a"}
        # a session planned before the ban, through the banned node, is repaired at its first step
        late = v.watch(FakeSession(HOPS), "cmpl-late")
        assert [e.code for e in late.session.failed] == [BANNED]
        assert v.telemetry(late) == {}  # nothing went through the node yet: the answer is not tainted
        assert Verifier(0.0).watch(FakeSession(HOPS), "x") is None  # off: nothing at all

    asyncio.run(scenario())


def test_watch_draws_audits_per_hop():
    v = Verifier(0.5)
    drawn = [len(v.watch(FakeSession(HOPS), None).audited) for _ in range(400)]
    assert 500 < sum(drawn) < 700  # 1200 (session, hop) pairs at rate 0.5
    watch = v.watch(FakeSession(HOPS), None)
    assert isinstance(watch, Watch) and (watch.session.sent == []) == bool(watch.audited)


# -- slow: a swarm with a liar ---------------------------------------------------------------------------------------

TTL_S = 10.0
PROMPT = "The capital of France is"
BOUND_S = 60.0  # a ban after the session that caught it ended: two replays of a short session (~5 s measured)


def get(url: str, timeout: float = 60) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(base: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream(base: str, body: dict) -> tuple[str, dict]:
    """A streamed completion: (its id, the telemetry of its last chunk)."""
    req = urllib.request.Request(
        base + "/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in (x.decode().strip() for x in r) if line[6:] and line[6:] != "[DONE]"]
    assert "error" not in chunks[-1], chunks[-1]
    return chunks[-1]["id"], chunks[-1]["telemetry"]


def route_of(telemetry: dict) -> list[str]:
    return [h["node"] for h in telemetry["route"]]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


@pytest.fixture(scope="module")
def swarm(gemma_path, tmp_path_factory):
    """Tracker, seeder, P (0:6 +embed), H1, H2, L (6:12; L with --test-lie noise), head (12:18), a verifying gateway.
    ``keys``: node key by URL; ``gw``: the gateway's Gateway object (tests steer routes with its suspects)."""
    from ggufswarm.net.http import ServerThread
    from ggufswarm.node.launch import start_nodes, stop_nodes
    from ggufswarm.runtime.shard import ShardSpec
    from ggufswarm.swarm.publish import publish
    from ggufswarm.swarm.torrent import Swarm, save_path_for
    from ggufswarm.tracker.app import TrackerConfig
    from ggufswarm.tracker.app import make_app as make_tracker_app

    work = tmp_path_factory.mktemp("verify")
    specs = [
        ShardSpec(0, 6, embed=True),
        ShardSpec(6, 12),
        ShardSpec(6, 12),
        ShardSpec(6, 12),
        ShardSpec(12, 18, head=True),
    ]
    lies = {3: ["--test-lie", "noise"]}
    with AppThread(lambda: make_tracker_app(TrackerConfig(db=":memory:", ttl_s=TTL_S, witness_age_s=0))) as tracker:
        published = publish(gemma_path, tracker, "gemma", work / "publisher")
        seeder = Swarm()
        seeder.seed(published.torrent, save_path_for([gemma_path]))
        extra = ["--tracker", tracker, "--hop-timeout", "10"]

        def launch(spec, i, more=()):
            return start_nodes(
                [spec],
                "gemma",
                threads=1,
                timeout=600,
                extra=extra,
                per_node=lambda _: ["--data-dir", str(work / f"node{i}"), *more],
            )[0]

        nodes = start_nodes(
            specs,
            "gemma",
            threads=1,
            timeout=600,
            extra=extra,
            per_node=lambda i: ["--data-dir", str(work / f"node{i}"), *lies.get(i, [])],
        )
        server = None
        try:
            listed = wait_for(lambda: len(ads := nodes_of(tracker)) == len(nodes) and ads, 60, "the nodes' adverts")
            app = make_app(
                GatewayConfig(
                    [], model="gemma", tracker=tracker, hop_timeout_s=10, data_dir=str(work / "gw"), verify_rate=1.0
                )
            )
            server = ServerThread(app)
            base = server.start()
            yield {
                "tracker": tracker,
                "base": base,
                "gw": app[GATEWAY],
                "nodes": nodes,
                "p": nodes[0].url,
                "honest": [nodes[1].url, nodes[2].url],
                "liar": nodes[3].url,
                "keys": {a["url"]: a["node_id"] for a in listed},
                "launch": launch,
            }
        finally:
            if server is not None:
                server.stop()
            stop_nodes(nodes)
            seeder.close()


def nodes_of(tracker: str) -> list[dict]:
    return get(f"{tracker}/nodes?model=gemma")["nodes"]


def steer(gw, avoid: list[str]) -> None:
    """New routes avoid ``avoid`` while another route exists (the gateway's suspects, for 30 s; not reported to the
    tracker, which would probe them and, should one be slow to answer on these loaded cores, drop it)."""
    gw.suspects.tracker = None
    for url in avoid:
        gw.suspects.add(url)


def clear_steering(gw) -> None:
    with gw.suspects._lock:
        gw.suspects._until.clear()


def settled(base: str, timeout: float = BOUND_S) -> dict:
    """The gateway's /v1/verify once no audit waits or runs, twice 1.5 s apart (a session is handed to the verifier
    after its answer, once its route's last replies are in: up to 1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        first = wait_for(lambda: (v := get(base + "/v1/verify"))["waiting"] == 0 and v, timeout, "the audits")
        time.sleep(1.5)
        again = get(base + "/v1/verify")
        if again["waiting"] == 0 and again["audits"] == first["audits"]:
            return again
        assert time.monotonic() < deadline, "timed out waiting for the audits"


_CAUGHT: dict = {}


@pytest.fixture(scope="module")
def caught(swarm):
    """Two sessions through the liar L at once: a short one, whose audit catches L, and a long stream that is still
    running when L is banned. Done once (both tests need L banned); what it saw."""
    if not _CAUGHT:
        base, gw = swarm["base"], swarm["gw"]
        steer(gw, swarm["honest"])
        t0 = time.monotonic()

        async def both():
            long = asyncio.to_thread(
                stream, base, {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
            )
            await asyncio.sleep(0.5)  # the long one first: it is planned through L too
            short = asyncio.to_thread(post, base, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            return await asyncio.gather(long, short)

        (long_id, long_tel), short = asyncio.run(both())
        clear_steering(gw)
        _CAUGHT.update(long_id=long_id, long=long_tel, short=short, seconds=time.monotonic() - t0, verify=settled(base))
    return _CAUGHT


@pytest.mark.slow
def test_a_liar_is_caught_confirmed_banned_and_routed_around(swarm, caught, gemma):
    from ggufswarm.net.identity import verify

    base, liar, honest, keys = swarm["base"], swarm["liar"], swarm["honest"], swarm["keys"]
    short, long_tel, view = caught["short"], caught["long"], caught["verify"]
    assert liar in route_of(short["telemetry"]), short["telemetry"]["route"]  # steered through L
    # the short session's audit found a mismatch, a third node confirmed it, L was banned with signed evidence
    [ban] = view["bans"]
    assert ban["key"] == keys[liar] and ban["url"] == liar and view["banned"] == [keys[liar]]
    evidence = ban["evidence"]
    accused, witnesses = evidence["accused"], evidence["witnesses"]
    assert accused["key"] == keys[liar] and {w["key"] for w in witnesses} == {keys[u] for u in honest}
    for part in (accused, *witnesses):
        signed = {k: v for k, v in part.items() if k != "sig"}
        verify(signed["key"], canonical(signed), part["sig"])  # anyone can check what each node said
    for w in witnesses:  # the same input after the same history, in the same context, another output
        assert (w["in"], w["prev"], w["ctx"]) == (accused["in"], accused["prev"], accused["ctx"]) and accused["prev"]
        assert w["out"] == witnesses[0]["out"] != accused["out"]
    assert evidence["context"]["numerics"] and evidence["context"]["layers"] == [6, 12]
    assert view["audits"]["confirmed"] >= 1 and view["audits"]["mismatch"] >= 1
    # ... on the tracker too, which checked the evidence itself: it lists the ban and no longer L, and a directory
    # reading its bans checks them again (its listing knows the witnesses)
    tracker_bans = {b["key"]: b for b in get(swarm["tracker"] + "/v1/bans")["bans"]}
    assert tracker_bans[keys[liar]]["evidence"] == evidence
    assert liar not in {a["url"] for a in nodes_of(swarm["tracker"])}
    known = {a["node_id"]: a for a in nodes_of(swarm["tracker"])}

    def witness(key, context):
        ad = known.get(key)
        return (
            "unknown"
            if ad is None
            else serves_context(served_context(ad["extra"], ad["layers"], ad["embed"], ad["head"]), context)
        )

    check_ban_evidence(keys[liar], evidence, witness)
    # the long stream ran through L when it was banned: repaired around it, and told so
    assert long_tel["tainted_by"] == [keys[liar]], long_tel
    assert any(r["hop"] == liar and r["cause"] == BANNED and r.get("replacement") for r in long_tel["repairs"])
    assert liar not in route_of(long_tel)
    now = get(base + "/v1/verify")  # (the other test may have banned its liar too, and tainted its answer)
    tainted = next(b["tainted"] for b in now["bans"] if b["key"] == keys[liar])
    assert set(tainted) == {short["id"], caught["long_id"]} and set(tainted) <= set(now["tainted"])
    # from now on no route goes through L, and greedy answers are llama.cpp's
    for prompt in (PROMPT, "def fibonacci(n):", "Москва — столица"):
        ref_text, _ = reference_of(gemma, prompt, 12)
        body = post(base, {"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert liar not in route_of(body["telemetry"]) and "tainted_by" not in body["telemetry"]
        assert body["choices"][0]["text"] == ref_text, prompt
    view = settled(base)
    # honest nodes were audited (each against the other) and never reported
    audits = view["recent"]
    assert any(a["result"] == "match" and a["key"] in {keys[u] for u in honest} for a in audits), audits
    for a in audits:
        if a["result"] in ("mismatch", "confirmed"):
            assert a["key"] not in {keys[u] for u in honest}, a
    assert keys[liar] in view["banned"] and not {keys[u] for u in honest} & set(view["banned"])
    health = get(base + "/health")["verify"]
    assert health["rate"] == 1.0 and health["sessions_to_catch"] == 1 and health["banned"] == view["banned"]
    metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert f'ggufswarm_gateway_audits_total{{result="confirmed"}} {float(view["audits"]["confirmed"])}' in metrics


def reference_of(model, prompt: str, n: int):
    from route_fixtures import reference

    return reference(model, prompt, n)


@pytest.mark.slow
def test_a_liar_every_50_steps_is_caught_on_a_long_session(swarm, caught):
    """A node lying on every 50th step only: a session of 60 steps through it is audited, the mismatch is at step 50,
    and it is banned in turn."""
    from ggufswarm.node.launch import stop_nodes
    from ggufswarm.runtime.shard import ShardSpec

    base, gw, tracker = swarm["base"], swarm["gw"], swarm["tracker"]
    sly = swarm["launch"](ShardSpec(6, 12), 9, ["--test-lie", "noise-every:50"])
    try:
        key = wait_for(
            lambda: next((a["node_id"] for a in nodes_of(tracker) if a["url"] == sly.url), None), 30, "its advert"
        )
        steer(gw, swarm["honest"])
        t0 = time.monotonic()
        body = post(base, {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
        clear_steering(gw)
        assert sly.url in route_of(body["telemetry"]), body["telemetry"]["route"]
        view = wait_for(lambda: key in (v := get(base + "/v1/verify"))["banned"] and v, BOUND_S, "the ban")
        detected = time.monotonic() - t0
        ban = next(b for b in view["bans"] if b["key"] == key)
        assert ban["evidence"]["step"] == 50 and ban["evidence"]["accused"]["step"] == 50
        assert body["id"] in ban["tainted"]
        print(f"noise-every:50 liar banned {detected:.1f} s after its 60-step session started")
    finally:
        stop_nodes([sly])


def cpu_variant_libs() -> str:
    """llama.cpp's libraries with AVX-only CPU kernels: another CPU kind on this machine (built once, ~1 minute)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_llama_cpp_python.sh"
    done = subprocess.run(["bash", str(script), "cpu-variant", sys.executable], capture_output=True, text=True)
    assert done.returncode == 0, f"building the AVX-only CPU variant failed:\n{done.stderr[-3000:]}"
    return done.stdout.split()[-1]


@pytest.mark.slow
def test_honest_nodes_of_another_cpu_kind_are_never_reported(swarm, caught, monkeypatch):
    """Two honest nodes of 6:12 on another CPU kind (llama.cpp with AVX-only kernels, through LLAMA_CPP_LIB_PATH: their
    bits differ from this machine's native kernels by up to ~5 % per row, bench/bench_numerics_kinds.py): their
    numerics id says so, each is replayed on the other, never on a node of the native kind, and over more than
    1,000 verified steps no honest node is reported."""
    from ggufswarm.node.launch import stop_nodes
    from ggufswarm.runtime.shard import ShardSpec

    base, gw, tracker, keys = swarm["base"], swarm["gw"], swarm["tracker"], swarm["keys"]
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", cpu_variant_libs())
    others = [swarm["launch"](ShardSpec(6, 12), 10 + i) for i in range(2)]
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH")
    try:
        urls = [n.url for n in others]
        ads = wait_for(
            lambda: (a := {x["url"]: x for x in nodes_of(tracker)}) and all(u in a for u in urls) and a, 30, "ads"
        )
        kinds = {u: ads[u]["extra"]["numerics"] for u in [*urls, *swarm["honest"]]}
        assert kinds[urls[0]]["id"] == kinds[urls[1]]["id"] != kinds[swarm["honest"][0]]["id"], kinds
        assert "AVX2" not in kinds[urls[0]]["cpu"] and kinds[urls[0]]["cpu"] != kinds[swarm["honest"][0]]["cpu"]
        honest = {keys[u] for u in swarm["honest"]} | {ads[u]["node_id"] for u in urls}
        answers = []
        six_twelve = [*swarm["honest"], *urls]
        for target in [*urls, *urls, *urls, *urls, *swarm["honest"]]:  # 10 sessions of 127 steps through 6:12
            steer(gw, [u for u in six_twelve if u != target])
            body = post(base, {"prompt": PROMPT, "max_tokens": 127, "temperature": 0, "ignore_eos": True})
            clear_steering(gw)
            assert target in route_of(body["telemetry"]), body["telemetry"]["route"]
            answers.append(body["id"])

        def audited():  # every answer's audit of hop 6:12 is done
            view = get(base + "/v1/verify")
            done = [a for a in view["recent"] if a["response_id"] in answers and a["layers"] == [6, 12]]
            return len({a["response_id"] for a in done}) == len(answers) and (view, done)

        view, mine = wait_for(audited, 300, "the audits of every answer")
        reported = [a for a in mine if a["result"] in ("mismatch", "confirmed", "unconfirmed")]
        assert not reported, reported
        assert sum(a["result"] == "match" for a in mine) >= len(answers) - 1, mine  # (one may find no shadow free)
        mine = [a for a in mine if a["result"] == "match"]
        for a in mine:  # each replayed on a node of its own kind
            assert (a["node"] in urls) == (a["shadow"] in urls), a
        verified = sum(a["compared"] for a in mine)
        print(f"\n{verified} verified steps of honest nodes of two CPU kinds: none reported")
        assert verified >= 1000 and {a["key"] for a in mine} <= honest
        assert not honest & set(view["banned"])
    finally:
        stop_nodes(others)


@pytest.mark.slow
def test_a_node_claiming_speed_it_lacks_gets_no_more_routes_than_measured(swarm, caught):
    """Placement sanity: a node of 6:12 advertising 0.01 ms per token while 80 ms slower (``--test-lie slow:80``). The
    tracker alone would route every session through it; the gateway times each node from outside (what the hop
    before it waited) and plans with that, so after one session the node gets no more routes."""
    from ggufswarm.node.launch import stop_nodes
    from ggufswarm.runtime.shard import ShardSpec

    base, gw, tracker = swarm["base"], swarm["gw"], swarm["tracker"]
    slow = swarm["launch"](ShardSpec(6, 12), 12, ["--test-lie", "slow:80"])
    try:
        ad = wait_for(lambda: next((a for a in nodes_of(tracker) if a["url"] == slow.url), None), 30, "its advert")
        assert ad["decode_ms"] == 0.01
        planned = get(f"{tracker}/route?model=gemma&max_length=64")["route"]  # the claim alone: it wins
        assert planned[1]["url"] == slow.url, [a["url"] for a in planned]
        routes = [
            route_of(post(base, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})["telemetry"]) for _ in range(4)
        ]
        through = [slow.url in r for r in routes]
        assert sum(through) <= 1 and not any(through[1:]), routes
        measured = gw.timings.get(ad["node_id"])
        assert measured is not None and measured >= 80, measured
        print(f"\nslow node measured at {measured:.1f} ms per decode step (claims 0.01): routes {through}")
    finally:
        stop_nodes([slow])
