"""Paths that had no test (issue 11, item 6): the KV budget in MiB, wire dtypes end to end, a non-head node
re-pushing a recorded step after its next hop failed, the gateway's max_completion_tokens and chat content parts,
the tracker and cache servers under a bounded fuzzer, --exit-with-parent, snapshots dropped after a truncate and
corrupt snapshots on restore."""

from __future__ import annotations

import uuid

import pytest
from aiohttp import web
from apphost import AppThread
from route_fixtures import http, open_greedy, tiny_split_route
from tinymodels import write_tiny_model

from ggufswarm.client.route import RemoteRoute
from ggufswarm.node.app import make_app as make_node_app
from ggufswarm.node.state import NodeConfig
from ggufswarm.protocol import decode_frame, encode_tokens
from ggufswarm.protocol.frame import HEADER_SIZE, ITEMSIZE
from ggufswarm.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
PROMPT = [5 + (i * 7) % 300 for i in range(20)]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return str(write_tiny_model(tiny_dir / "paths-llama.gguf", "llama", n_layers=2))


@pytest.fixture(scope="module")
def route(model, tiny_dir):
    """[0,1) + embedding, [1,2) + head, and the whole model on one node (the reference)."""
    with tiny_split_route(model, tiny_dir / "paths") as nodes:
        yield nodes


def health(url: str) -> dict:
    status, body = http("GET", url + "/health")
    assert status == 200
    return body


# -- --kv-budget-mb -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_kv_budget_mb_caps_the_budget_in_tokens(model, tiny_dir, backend):
    """``--kv-budget-mb``: the budget in tokens is the MiB cap over the shard's kv_bytes_per_token (from /health);
    a session beyond it is refused (kv_budget_too_small), and with the budget taken another is refused
    (kv_budget_full)."""
    mb = 0.25
    with AppThread(
        lambda: make_node_app(
            NodeConfig(
                layers="0:2",
                embed=True,
                head=True,
                model=model,
                backend=backend,
                kv_budget_mb=mb,
                max_sessions=1,
                data_dir=str(tiny_dir / f"kvmb-{backend}"),
            )
        )
    ) as url:
        h = health(url)
        budget = int(mb * 2**20) // h["kv_bytes_per_token"]
        assert 0 < budget < NodeConfig.kv_budget_tokens
        assert h["kv_budget_tokens"] == budget
        status, body = http("POST", url + "/v1/sessions", {"max_length": budget + 1})
        assert status == 503 and body["error"]["code"] == "kv_budget_too_small"
        if backend == "torch":  # llama.cpp also caps one session at its context's cells per sequence
            status, body = http("POST", url + "/v1/sessions", {"max_length": budget})
            assert status == 201 and body["kv_budget_tokens"] == budget
            sid = body["session_id"]
            status, body = http("POST", url + "/v1/sessions", {"max_length": 1})
            assert status == 429 and body["error"]["code"] == "kv_budget_full"
            assert http("DELETE", f"{url}/v1/sessions/{sid}")[0] == 200


# -- wire dtypes end to end -------------------------------------------------------------------------------------


def run_route(urls: list[str], wire_dtype: str, n: int = 5):
    """Greedy tokens of ``n`` steps over ``urls`` with ``wire_dtype`` frames, and the session's telemetry."""
    session = RemoteRoute(urls).open(64, GREEDY, wire_dtype=wire_dtype, top_logprobs=5)
    try:
        out, logprobs = [session.step(PROMPT)], [session.last_logprobs]
        for _ in range(n - 1):
            out.append(session.step([out[-1]]))
            logprobs.append(session.last_logprobs)
        return out, logprobs, session.telemetry
    finally:
        session.close()


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16"])
def test_wire_dtypes_end_to_end(route, wire_dtype):
    """f32 frames give exactly the whole model on one node; bf16 frames run, and the head received frames of
    that width on every decode step (header + n_embd values of 2 bytes + the int32 token id trailer)."""
    want, want_lp, _ = run_route([route["whole"]], "f32")
    got, got_lp, telemetry = run_route([route["first"], route["head"]], wire_dtype)
    n_embd = health(route["head"])["n_embd"]
    decode = [s for s in telemetry.steps if s.n_tokens == 1]
    assert len(decode) == len(got) - 1
    for s in decode:
        assert s.bytes_in[1] == HEADER_SIZE + n_embd * ITEMSIZE[wire_dtype] + 4
    prefill = telemetry.steps[0]
    assert prefill.bytes_in[1] == HEADER_SIZE + len(PROMPT) * (n_embd * ITEMSIZE[wire_dtype] + 4)
    if wire_dtype == "f32":
        assert got == want and got_lp == want_lp
    else:  # bf16 frames: not what f16 or f32 frames give (the head decoded bf16 values)
        assert len(got) == len(want) and all(0 <= t < health(route["head"])["n_vocab"] for t in got)
        f16_lp = run_route([route["first"], route["head"]], "f16")[1]
        assert got_lp != want_lp and got_lp != f16_lp


# -- a non-head node re-pushing a recorded step -----------------------------------------------------------------


def test_non_head_node_re_pushes_a_recorded_step_after_its_next_hop_failed(route):
    """A step the first node applied but whose next hop failed is recorded without a reply: the retry (same step
    number) is pushed downstream again with the same frame, and never applied twice."""
    frames: list[bytes] = []

    async def step(request):
        frames.append(await request.read())
        if len(frames) == 1:
            return web.json_response({"error": {"code": "internal", "message": "down"}}, status=500)
        frame = decode_frame(frames[-1])
        return web.json_response(
            {
                "token": 7 + frame.n_tokens,
                "hops": [{"compute_ms": 0.0, "bytes_in": 0, "kv_tokens": 0, "handle_ms": 0.0}],
            }
        )

    def fake_head():
        app = web.Application()
        app.router.add_post("/v1/step", step)
        return app

    first = route["first"]
    with AppThread(fake_head) as fake:
        sid = uuid.uuid4()
        status, _ = http("POST", first + "/v1/sessions", {"session_id": str(sid), "max_length": 64, "next_hop": fake})
        assert status == 201
        try:
            before = health(first)
            frame = encode_tokens(sid, 1, 0, PROMPT)
            status, body = http("POST", first + "/v1/step", frame)
            assert status >= 500 and len(frames) == 1
            after_fail = health(first)
            assert after_fail["prefill_steps"] == before["prefill_steps"] + 1
            status, body = http("POST", first + "/v1/step", frame)  # the retry: same step number and frame
            assert status == 200 and body["token"] == 7 + len(PROMPT) and len(body["hops"]) == 2
            assert len(frames) == 2 and frames[1] == frames[0]
            after = health(first)
            assert after["prefill_steps"] == after_fail["prefill_steps"]  # not applied again
            assert after["replays"] == after_fail["replays"] + 1
            # a third send of the same step is answered from the record: nothing goes downstream
            status, again = http("POST", first + "/v1/step", frame)
            assert status == 200 and again == body and len(frames) == 2
            # and the session goes on at the right position
            status, body = http("POST", first + "/v1/step", encode_tokens(sid, 2, len(PROMPT), [3]))
            assert status == 200 and body["token"] == 8 and len(frames) == 3
        finally:
            http("DELETE", f"{first}/v1/sessions/{sid}")


# -- gateway: max_completion_tokens, chat content parts -----------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(route, model):
    from ggufswarm.gateway import GatewayConfig, make_app
    from ggufswarm.net.http import ServerThread

    server = ServerThread(make_app(GatewayConfig([route["whole"]], model=model)))
    yield server.start()
    server.stop()


def test_max_completion_tokens_limits_the_completion(gateway):
    """OpenAI's newer name for max_tokens limits the completion as max_tokens does, and wins over max_tokens."""
    base = {"messages": [{"role": "user", "content": "the a of"}], "temperature": 0, "ignore_eos": True}
    status, by_old = http("POST", gateway + "/v1/chat/completions", {**base, "max_tokens": 3})
    assert status == 200 and by_old["usage"]["completion_tokens"] == 3
    status, by_new = http("POST", gateway + "/v1/chat/completions", {**base, "max_completion_tokens": 3})
    assert status == 200 and by_new["usage"]["completion_tokens"] == 3
    assert by_new["choices"][0]["message"]["content"] == by_old["choices"][0]["message"]["content"]
    assert by_new["choices"][0]["finish_reason"] == "length"
    status, both = http("POST", gateway + "/v1/chat/completions", {**base, "max_completion_tokens": 2, "max_tokens": 5})
    assert status == 200 and both["usage"]["completion_tokens"] == 2
    status, body = http(
        "POST",
        gateway + "/v1/completions",
        {"prompt": "the a of", "temperature": 0, "ignore_eos": True, "max_completion_tokens": 4},
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_chat_content_parts_are_the_plain_string(gateway):
    """Text content parts give the same prompt (tokens and completion) as the string they join to; a non-text
    part is a 400 naming messages."""
    base = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat of the a"}]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": " of the a"}]},
    ]
    status, want = http("POST", gateway + "/v1/chat/completions", {**base, "messages": plain})
    assert status == 200
    status, got = http("POST", gateway + "/v1/chat/completions", {**base, "messages": parts})
    assert status == 200
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    status, shorter = http(
        "POST",
        gateway + "/v1/chat/completions",
        {**base, "messages": [plain[0], {"role": "user", "content": [{"type": "text", "text": "the cat"}]}]},
    )
    assert status == 200 and shorter["usage"]["prompt_tokens"] < want["usage"]["prompt_tokens"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, body = http(
        "POST",
        gateway + "/v1/chat/completions",
        {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]},
    )
    assert status == 400 and body["error"]["param"] == "messages[0].content[1]"


# -- the tracker and the cache under a bounded fuzzer ------------------------------------------------------------

FUZZ_BODIES = {
    "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep object": b'{"a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "not json": b"\xff\xfe{not json",
    "latin1": '{"url": "\u00e9\u00ff", "model": "m\u00e9"}'.encode("latin-1"),
    "array": b"[1, 2, 3]",
    "junk": b'{"node_id": [], "url": {}, "model": null, "layers": "x", "manifest": 1, "torrent_hex": "zz",'
    b' "tokens": [1e999], "layers_": -1}',
    "empty": b"",
}
FUZZ_CTYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=no-such-charset",
    "application/json; charset=latin-1",
    "text/plain",
    "application/octet-stream",
    None,
]
# Not "deflate": a body that does not inflate as deflate sometimes gets no answer at all from aiohttp 3.14 (the
# request hangs until the client's timeout, on the tracker and the cache alike; seen for 5 random bytes on
# POST /nodes/report and /v1/lookup): an aiohttp parser problem, left out until it is understood.
FUZZ_ENCODINGS = [None, None, "gzip", "br", "x-unknown"]
FUZZ_PATHS = [
    "/",
    "/v1",
    "/nope",
    "/nodes/",
    "/v1/snapshots/",
    "/v1/snapshots/" + "0" * 64 + "/x",
    "/%2e%2e/health",
    "/manifests/",
    "/v2/lookup",
]


def fuzz_send(url: str, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, str, bytes]:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def fuzz_server(url: str, app_routes: list[tuple[str, str]], alive_path: str, examples: int) -> dict:
    """Send ``examples`` generated odd requests to a server whose router holds ``app_routes`` ((method, template));
    every answer is a success or a JSON ``{"error": {code, message}}`` 4xx (never 5xx), and ``alive_path`` answers
    200 throughout. The (status, code) counts."""
    import gzip
    import json as jsonlib
    import re

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen: dict = {}
    templates = sorted({t for _, t in app_routes})
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

    def send(p: dict) -> None:
        path = re.sub(r"\{[^}]*\}", p["var"], p["template"])
        name = p["body"]
        body = bytes.fromhex(name[4:]) if name.startswith("raw:") else FUZZ_BODIES[name]
        headers = {}
        if p["ctype"]:
            headers["Content-Type"] = p["ctype"]
        if p["encoding"]:
            headers["Content-Encoding"] = p["encoding"]
            if p["encoding"] == "gzip" and p["gzip_ok"]:
                body = gzip.compress(body)
        status, ctype, data = fuzz_send(url, p["method"], path, body if p["method"] != "GET" else None, headers)
        what = (p["method"], path, name, headers, status, data[:200])
        assert status < 500, what
        if status >= 400 and not ctype.startswith("application/json"):
            # aiohttp's HTTP parser refuses a body it cannot decode (a Content-Encoding with no decoder, such as br
            # without Brotli, or bytes that do not inflate) as they arrive, before any handler or middleware runs (as
            # for the node, tests/test_fuzz.py): a plain 400, and the server serves on
            encoded = p["encoding"] == "gzip" and p["gzip_ok"]
            assert status == 400 and p["encoding"] and not encoded, what
            seen[(status, "aiohttp")] = seen.get((status, "aiohttp"), 0) + 1
        elif status >= 400:
            err = jsonlib.loads(data)["error"]
            assert isinstance(err["code"], str) and isinstance(err["message"], str) and err["message"], what
            seen[(status, err["code"])] = seen.get((status, err["code"]), 0) + 1
        else:
            seen[(status, "ok")] = seen.get((status, "ok"), 0) + 1
        assert fuzz_send(url, "GET", alive_path, None, {})[0] == 200, what

    # first a sweep: every route with every odd body, charset and Content-Encoding (the random plans below rarely
    # pair a deep body with a route that parses JSON)
    plain = {"ctype": "application/json", "encoding": None, "var": "x", "gzip_ok": True, "body": "junk"}
    for method, template in app_routes:
        sweep = [{"body": name} for name in sorted(FUZZ_BODIES)] + [{"ctype": c} for c in FUZZ_CTYPES]
        sweep += [{"encoding": e, "gzip_ok": ok} for e in FUZZ_ENCODINGS if e for ok in (True, False)]
        sweep += [{"body": "deep", "encoding": "gzip"}]
        for change in sweep:
            send({**plain, "method": method, "template": template, **change})

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(
        st.fixed_dictionaries(
            {
                "template": st.sampled_from(templates + FUZZ_PATHS),
                "method": st.sampled_from(methods),
                "body": st.sampled_from(sorted(FUZZ_BODIES)) | st.binary(max_size=64).map(lambda b: "raw:" + b.hex()),
                "ctype": st.sampled_from(FUZZ_CTYPES),
                "encoding": st.sampled_from(FUZZ_ENCODINGS),
                "var": st.sampled_from(["x", "0" * 64, "%00", "%ff%fe", "a" * 300, "..", "{sid}"]),
                "gzip_ok": st.booleans(),
            }
        )
    )
    def one(p):
        send(p)

    one()
    return seen


def router_routes(app) -> list[tuple[str, str]]:
    out = []
    for r in app.router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        template = info.get("path") or info.get("formatter")
        if template and r.method != "HEAD":
            out.append((r.method, template))
    return out


def test_tracker_under_a_bounded_fuzzer(tmp_path):
    """Deeply nested JSON, bad charsets, bad Content-Encoding, unknown paths and methods: JSON 4xx, never 5xx;
    the tracker keeps serving."""
    from ggufswarm.tracker.app import TrackerConfig
    from ggufswarm.tracker.app import make_app as make_tracker_app

    make = lambda: make_tracker_app(TrackerConfig(db=str(tmp_path / "t.sqlite"), token=None))
    with AppThread(make) as url:
        seen = fuzz_server(url, router_routes(make()), "/models", 300)
    assert any(code == "not_found" for _, code in seen) and any(code == "method_not_allowed" for _, code in seen)


def test_cache_under_a_bounded_fuzzer(tmp_path):
    """The same fuzzer against the snapshot cache server."""
    from ggufswarm.cache.app import CacheConfig
    from ggufswarm.cache.app import make_app as make_cache_app

    make = lambda: make_cache_app(CacheConfig(dir=str(tmp_path / "c"), max_bytes=10**6, token=None))
    with AppThread(make) as url:
        seen = fuzz_server(url, router_routes(make()), "/health", 300)
    assert any(code == "not_found" for _, code in seen) and any(code == "method_not_allowed" for _, code in seen)


# -- --exit-with-parent ---------------------------------------------------------------------------------------

PARENT = """
import subprocess, sys, time
log = open(sys.argv[1], "w")
child = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_exit_with_parent(model, tmp_path, ggufswarm_cli):
    """A node started with --exit-with-parent by a parent that is then SIGKILLed exits by itself, within a bound."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    import psutil

    log = tmp_path / "node.log"
    cmd = [
        *ggufswarm_cli,
        "node",
        "--layers",
        "0:2",
        "--embed",
        "--head",
        "--model",
        model,
        "--port",
        "0",
        "--backend",
        "torch",
        "--data-dir",
        str(tmp_path / "d"),
        "--exit-with-parent",
    ]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(log), *cmd], stdout=subprocess.PIPE, text=True)
    try:
        node = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 120  # torch's import alone takes seconds on a loaded machine
        while not (m := re.search(r"ready: (http://\S+)", log.read_text())):
            assert node.is_running() and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert http("GET", m.group(1) + "/health")[0] == 200
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15  # the node checks its parent every 0.5 s, then shuts down
        while node.is_running() and node.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the node outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(10)
        try:
            node.kill()
        except (psutil.NoSuchProcess, NameError):
            pass


# -- snapshots: dropped when truncated meanwhile, a corrupt one is a miss -----------------------------------------


def poll(fn, deadline_s: float = 20.0):
    """Call ``fn`` until it returns something true, against a deadline; that value (or the last, false)."""
    import time

    end = time.monotonic() + deadline_s
    while not (got := fn()) and time.monotonic() < end:
        time.sleep(0.02)
    return got


def test_snapshot_of_a_session_truncated_meanwhile_is_dropped(model, tmp_path):
    """A snapshot whose session is truncated while it is being taken is dropped (counter ``dropped``), not stored."""
    import threading

    from ggufswarm.cache.app import CacheConfig
    from ggufswarm.cache.app import make_app as make_cache_app
    from ggufswarm.node.state import NODE

    with AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path / "c"), max_bytes=10**8))) as cache:
        app = make_node_app(
            NodeConfig(layers="0:2", embed=True, head=True, model=model, cache=cache, snapshot_every=0, backend="torch")
        )
        link = app[NODE].snapshots
        with AppThread(lambda: app) as node:
            release = threading.Event()
            link.pool.submit(release.wait, 30)  # the snapshot thread (one worker) is busy: the encode waits
            try:
                sid = open_greedy(node)
                assert http("POST", node + "/v1/step", encode_tokens(sid, 1, 0, PROMPT * 2))[0] == 200
                assert poll(lambda: link.uploading(sid))  # the snapshot of the prefill was taken, not yet encoded
                status, body = http("POST", f"{node}/v1/sessions/{sid}/truncate", {"length": 16})
                assert status == 200 and body["length"] == 16
            finally:
                release.set()
            poll(lambda: health(node)["snapshots"]["dropped"] or health(node)["snapshots"]["written"])
            counters = health(node)["snapshots"]
            assert counters["dropped"] == 1 and counters["written"] == 0 and counters["failed"] == 0
            assert http("GET", cache + "/health")[1]["snapshots"] == 0
            # without a truncate the same snapshot is stored
            other = open_greedy(node)
            assert http("POST", node + "/v1/step", encode_tokens(other, 1, 0, PROMPT * 2))[0] == 200
            assert poll(lambda: health(node)["snapshots"]["written"] == 1)
            assert health(node)["snapshots"]["dropped"] == 1


def test_corrupt_snapshot_is_a_miss_and_the_node_computes(model, tmp_path):
    """A stored snapshot whose bytes fail their SHA-256 check on restore: the cache answers 410 snapshot_corrupt
    (and counts it), the node restores nothing and computes, answering as a session that never tried a restore."""
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.cache.app import CacheConfig
    from ggufswarm.cache.app import make_app as make_cache_app

    prompt = PROMPT * 2  # 40 tokens: more than two 16-token blocks
    with (
        AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path / "c"), max_bytes=10**8))) as cache,
        AppThread(
            lambda: make_node_app(
                NodeConfig(
                    layers="0:2", embed=True, head=True, model=model, cache=cache, snapshot_every=0, backend="torch"
                )
            )
        ) as node,
    ):
        a = open_greedy(node)
        status, first = http("POST", node + "/v1/step", encode_tokens(a, 1, 0, prompt))
        assert status == 200
        assert poll(lambda: health(node)["snapshots"]["written"] == 1)
        found = http(
            "POST",
            cache + "/v1/lookup",
            {"model": GGUFModelFile(model).fingerprint, "layers": [0, 2], "dtype": "float32", "tokens": prompt},
        )[1]
        assert found["key"] and found["length"] == 32
        # untouched, the snapshot restores
        b = open_greedy(node)
        status, restored = http("POST", f"{node}/v1/sessions/{b}/restore", {"tokens": prompt})
        assert status == 200 and restored["length"] == len(prompt), restored
        http("DELETE", f"{node}/v1/sessions/{b}")
        # flip one byte of the stored blob
        path = tmp_path / "c" / found["key"][:2] / f"{found['key']}.kv"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        c = open_greedy(node)
        status, miss = http("POST", f"{node}/v1/sessions/{c}/restore", {"tokens": prompt})
        assert status == 200 and miss["length"] == 0 and "410" in miss["reason"], miss
        cache_health = http("GET", cache + "/health")[1]
        assert cache_health["corrupt"] == 1 and cache_health["snapshots"] == 0  # deleted
        status, got = http("POST", node + "/v1/step", encode_tokens(c, 1, 0, prompt))
        assert status == 200 and got["token"] == first["token"] and got["logprobs"] == first["logprobs"]
        # the cache's own answer for such a blob
        d = open_greedy(node)
        assert http("POST", node + "/v1/step", encode_tokens(d, 1, 0, [9] * 40))[0] == 200

        def lookup_d():  # d's snapshot (c's recomputed prompt may be written again first: poll for d's own)
            return http(
                "POST",
                cache + "/v1/lookup",
                {"model": GGUFModelFile(model).fingerprint, "layers": [0, 2], "dtype": "float32", "tokens": [9] * 40},
            )[1].get("key")

        assert poll(lambda: lookup_d() is not None)
        key = lookup_d()
        path = tmp_path / "c" / key[:2] / f"{key}.kv"
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        status, body = http("GET", f"{cache}/v1/snapshots/{key}")
        assert status == 410 and body["error"]["code"] == "snapshot_corrupt"


# -- the shared JSON body reader: nesting is bounded before parsing ----------------------------------------------


def test_json_depth_counts_nesting_not_brackets_in_strings():
    from ggufswarm.net.http import MAX_JSON_DEPTH, json_depth

    assert json_depth('{"a": [1, {"b": []}]}') == 4
    in_strings = '{"a": "' + "[" * (3 * MAX_JSON_DEPTH) + '", "b": "\\"[{"}'
    assert json_depth(in_strings) == 1  # many brackets, all inside strings (one behind an escaped quote)
    assert json_depth("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)) == MAX_JSON_DEPTH + 1
    wide = "[" + ",".join(["[]"] * (5 * MAX_JSON_DEPTH)) + "]"  # many brackets, shallow
    assert json_depth(wide) == 2


@pytest.mark.parametrize("server", ["tracker", "cache"])
def test_deep_json_is_refused_before_parsing(tmp_path, server):
    """A body nested 100,000 levels deep is a 400 naming the depth limit, answered without json.loads ever
    recursing (which, near the recursion limit, broke even garbage-collector finalisers in the server thread)."""
    import json as jsonlib

    from ggufswarm.cache.app import CacheConfig
    from ggufswarm.cache.app import make_app as make_cache_app
    from ggufswarm.tracker.app import TrackerConfig
    from ggufswarm.tracker.app import make_app as make_tracker_app

    make, path, code = {
        "tracker": (lambda: make_tracker_app(TrackerConfig(db=":memory:", token=None)), "/nodes/heartbeat", "bad_json"),
        "cache": (
            lambda: make_cache_app(CacheConfig(dir=str(tmp_path / "c"), max_bytes=10**6, token=None)),
            "/v1/lookup",
            "bad_request",
        ),
    }[server]
    with AppThread(make) as url:
        status, _, data = fuzz_send(url, "POST", path, FUZZ_BODIES["deep"], {"Content-Type": "application/json"})
    err = jsonlib.loads(data)["error"]
    assert (status, err["code"]) == (400, code) and "nested deeper than" in err["message"], (status, err)
