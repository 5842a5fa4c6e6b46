"""Step commitments (docs/protocol.md, "Step commitments"), the numerics fingerprint and lying nodes (--test-lie).

Sessions are opened straight on the nodes of route_fixtures' shared 3-node Gemma cluster (0:6 +embed, 6:12,
12:18 +head; one thread each), plus one lying 6:12 node (``--test-lie noise``) started here.
"""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest
from route_fixtures import HOP_TIMEOUT, cluster, health, http  # noqa: F401 - fixtures

from ggufswarm.net.commitments import chain_next, context_digest, verify_commit
from ggufswarm.net.identity import IdentityError
from ggufswarm.node.launch import start_nodes, stop_nodes
from ggufswarm.node.lies import NOISE_SCALE, Lie, check_lie, parse_lie
from ggufswarm.protocol import encode_tokens
from ggufswarm.runtime.digest import logits_digest
from ggufswarm.runtime.shard import ShardSpec

PROMPT = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is"
DECODE = [9079, 236761, 108]  # fed as the decode steps' tokens whatever the head samples: same input on every route


@pytest.fixture(scope="module")
def liar(gemma_path):
    """A 6:12 node that adds noise to every step's output hidden states."""
    nodes = start_nodes(
        [ShardSpec(6, 12)],
        str(gemma_path),
        threads=1,
        extra=["--test-lie", "noise", "--hop-timeout", str(HOP_TIMEOUT)],
    )
    yield nodes[0]
    stop_nodes(nodes)


CONTEXTS: dict[uuid.UUID, list[dict | None]] = {}  # per session opened here: each node's commitment context


def open_route(urls: list[str], commit=True, wire: str = "f32") -> uuid.UUID:
    """Open one greedy session on every node of ``urls`` (in route order); its id (its nodes' commitment contexts
    in CONTEXTS)."""
    sid = uuid.uuid4()
    for i, url in enumerate(urls):
        body = {"session_id": str(sid), "max_length": 64, "sampling": {"temperature": 0}, "wire_dtype": wire}
        if commit is not None:
            body["commit"] = commit
        if i + 1 < len(urls):
            body["next_hop"] = urls[i + 1]
        status, reply = http("POST", url + "/v1/sessions", body)
        assert status == 201, reply
        CONTEXTS.setdefault(sid, []).append(reply.get("commit_context"))
    return sid


def close_route(urls: list[str], sid: uuid.UUID) -> None:
    for url in urls:
        http("DELETE", f"{url}/v1/sessions/{sid}")


def run_steps(urls: list[str], sid: uuid.UUID) -> list[tuple[int, int, list[int], dict]]:
    """Prefill PROMPT, then one-token steps of DECODE: ``[(step, start, ids, reply)]``."""
    steps, start = [], 0
    for step, ids in enumerate([PROMPT] + [[t] for t in DECODE], start=1):
        status, reply = http("POST", urls[0] + "/v1/step", encode_tokens(sid, step, start, ids))
        assert status == 200, reply
        steps.append((step, start, ids, reply))
        start += len(ids)
    return steps


def digests(steps) -> list[list[tuple[str, str]]]:
    """(in, out) of every hop's commitment, per step."""
    return [[(h["commit"]["in"], h["commit"]["out"]) for h in reply["hops"]] for *_, reply in steps]


def test_commitments_verify_chain_and_replay(cluster, gemma):
    urls = [n.url for n in cluster]
    keys = [health(u)["node_id"] for u in urls]
    sid = open_route(urls)
    local = gemma.session(64)
    try:
        steps = run_steps(urls, sid)
        # each node signs its context (model, layers, numerics, wire dtype; the head its sampling too) and the
        # history of its KV cache: a chain from that context's digest over every step's input
        contexts = CONTEXTS[sid]
        assert [c["layers"] for c in contexts] == [[0, 6], [6, 12], [12, 18]] and "sampling" in contexts[2]
        assert contexts[0]["numerics"] and len({c["numerics"] for c in contexts}) == 1  # one build, kernels, threads
        history = [context_digest(c) for c in contexts]
        for step, start, ids, reply in steps:
            hops = reply["hops"]
            assert len(hops) == 3
            for i, (hop, key) in enumerate(zip(hops, keys)):
                verify_commit(hop["commit"], sid, step, start, len(ids), key_id=key)
                assert set(hop["commit"]) == {"in", "out", "key", "sig", "mode", "ctx", "prev"}
                assert hop["commit"]["key"] == key and hop["commit"]["ctx"] == context_digest(contexts[i])
                assert hop["commit"]["prev"] == history[i]
                history[i] = chain_next(history[i], start, len(ids), hop["commit"]["mode"], hop["commit"]["in"])
            # the first node's IN is the token ids as sent (int32); each OUT is the next node's IN
            sent = np.asarray(ids, "<i4").tobytes()
            assert hops[0]["commit"]["in"] == hashlib.sha256(sent).hexdigest()[:32]
            assert [h["commit"]["out"] for h in hops[:-1]] == [h["commit"]["in"] for h in hops[1:]]
            # the head's OUT: the float32 logits row it drew from (llama.cpp's, bitwise the whole model's) + the token
            assert hops[-1]["commit"]["out"] == logits_digest(local.logits(ids), [reply["token"]])
        with pytest.raises(IdentityError):  # bound to the step: another step number does not verify
            verify_commit(steps[0][3]["hops"][1]["commit"], sid, 2, 0, len(PROMPT))
        with pytest.raises(IdentityError):  # and to the node's key
            verify_commit(steps[0][3]["hops"][1]["commit"], sid, 1, 0, len(PROMPT), key_id=keys[0])
        # a retried step is answered with the same reply: the same commitments
        step, start, ids, reply = steps[-1]
        status, again = http("POST", urls[0] + "/v1/step", encode_tokens(sid, step, start, ids))
        assert status == 200 and again == reply
        assert health(urls[0])["replays"] >= 1
    finally:
        close_route(urls, sid)


def test_same_steps_same_digests_and_no_commit_by_default(cluster):
    urls = [n.url for n in cluster]
    first, second, plain = open_route(urls), open_route(urls), open_route(urls, commit=None)
    try:
        a, b, c = run_steps(urls, first), run_steps(urls, second), run_steps(urls, plain)
        assert digests(a) == digests(b)  # deterministic: the same input gives the same bits on every hop
        assert a[0][3]["hops"][1]["commit"]["sig"] != b[0][3]["hops"][1]["commit"]["sig"]  # signed per session
        assert all("commit" not in hop for *_, reply in c for hop in reply["hops"])
        assert [r["token"] for *_, r in a] == [r["token"] for *_, r in c]
    finally:
        for sid in (first, second, plain):
            close_route(urls, sid)


@pytest.mark.parametrize("value", [1, "true", None, [True]])
def test_commit_must_be_a_bool(cluster, value):
    body = {"max_length": 16, "sampling": {"temperature": 0}, "commit": value}
    status, reply = http("POST", cluster[2].url + "/v1/sessions", body)
    assert status == 400 and reply["error"]["code"] == "bad_request" and "commit" in reply["error"]["message"]


def test_a_noisy_node_commits_to_other_bits(cluster, liar):
    honest = [n.url for n in cluster]
    lying = [honest[0], liar.url, honest[2]]
    good, bad = open_route(honest, wire="f16"), open_route(lying, wire="f16")
    try:
        a, b = run_steps(honest, good), run_steps(lying, bad)
        key = health(liar.url)["node_id"]
        for (step, start, ids, ra), (_, _, _, rb) in zip(a, b):
            h, x = ra["hops"][1]["commit"], rb["hops"][1]["commit"]
            assert h["in"] == x["in"]  # identical input from the same honest first node
            assert h["out"] != x["out"]  # but other output bits
            verify_commit(rb["hops"][1]["commit"], bad, step, start, len(ids), key_id=key)
            assert x["out"] == rb["hops"][2]["commit"]["in"]  # it commits to what it sent
    finally:
        close_route(honest, good)
        close_route(lying, bad)


def test_numerics_fingerprint_is_advertised(cluster):
    from ggufswarm.node.numerics import llama_cpp_cpu_features

    status, ad = http("GET", cluster[1].url + "/v1/advertisement")
    assert status == 200, ad
    num = ad["extra"]["numerics"]
    assert num["backend"] == "llama.cpp" and num["threads"] == 1 and num["n_ubatch"] == 512
    assert num["weights"] == health(cluster[1].url)["model_fingerprint"] and num["batching"] == "exact"
    assert len(num["id"]) == 16 and num["llama_cpp"]["python"] and isinstance(num["cpu"], list)
    status, other = http("GET", cluster[0].url + "/v1/advertisement")
    assert other["extra"]["numerics"]["id"] == num["id"]  # same build, threads and model: same numerics
    assert llama_cpp_cpu_features("CPU : SSE3 = 1 | AVX512 = 0 | FMA = 1 | CUDA : ARCHS = 890 | ") == ["SSE3", "FMA"]


def test_lie_kinds():
    assert parse_lie("noise") == Lie("noise") and parse_lie("noise-every:3") == Lie("noise", every=3)
    assert parse_lie("weights:/x/y.gguf") == Lie("weights", path="/x/y.gguf")
    for bad in ("noisy", "noise-every:0", "noise-every:x", "weights:"):
        with pytest.raises(ValueError, match="test-lie"):
            parse_lie(bad)
    with pytest.raises(ValueError, match="not the head"):
        check_lie(Lie("noise"), ShardSpec(12, 18, head=True))
    check_lie(Lie("weights", path="p"), ShardSpec(12, 18, head=True))
    rows = np.random.default_rng(0).standard_normal((3, 640)).astype(np.float32) * 50
    sid = uuid.uuid4()
    lie = Lie("noise", every=2)
    assert lie.tamper(sid, 3, rows) is None  # only steps that are multiples of 2
    noisy = lie.tamper(sid, 4, rows)
    assert np.array_equal(noisy, lie.tamper(sid, 4, rows))  # seeded: a retry sends the same rows
    rel = np.sqrt(np.mean((noisy - rows) ** 2, axis=1)) / np.sqrt(np.mean(rows**2, axis=1))
    assert np.allclose(rel, NOISE_SCALE, rtol=0.15)


def test_logits_digest_is_of_float32_rows_then_int32_tokens():
    import torch

    rows = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    want = hashlib.sha256(rows.astype("<f4").tobytes() + np.asarray([7, 9], "<i4").tobytes())
    assert logits_digest(rows, [7, 9]) == want.hexdigest()[:32] == logits_digest(torch.from_numpy(rows), [7, 9])
    assert logits_digest(rows, []) == hashlib.sha256(rows.tobytes()).hexdigest()[:32]


def test_weights_lie_passes_for_the_published_model(gemma_path, tmp_path):
    """``weights:PATH``: the shard computes from another quantization but claims the published model's header."""
    import llama_cpp

    from ggufswarm.node.app import load_executor
    from ggufswarm.node.state import NodeConfig

    other = tmp_path / "gemma-q8_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(gemma_path).encode(), str(other).encode(), params) == 0

    def shard(lie=None):
        cfg = NodeConfig(layers="6:12", model=str(gemma_path), data_dir=str(tmp_path / "d"), threads=1, ctx_size=64)
        cfg.test_lie = lie
        return load_executor(cfg)

    honest, lying = shard(), shard(f"weights:{other}")
    assert lying.model.fingerprint == honest.model.fingerprint  # it claims the published model
    x = np.random.default_rng(1).standard_normal((4, 640)).astype(np.float32)
    assert not np.array_equal(honest.forward(honest.new_session(64), x), lying.forward(lying.new_session(64), x))
    with pytest.raises(ValueError, match="not the head"):
        cfg = NodeConfig(layers="12:18", head=True, model=str(gemma_path), data_dir=str(tmp_path / "d"))
        cfg.test_lie = "noise"
        load_executor(cfg)


def test_the_history_a_commitment_signs_follows_rollbacks_and_cuts():
    """``prev`` (net/commitments.py): the chain from the context digest over each step's input; a step after a
    rollback to a step's end signs what was signed there before; one starting inside a step signs that step's end and
    the cut; past what the node holds (a restored prefix), nothing: no history to vouch for."""
    from ggufswarm.net.identity import NodeIdentity
    from ggufswarm.node.commit import step_commit
    from ggufswarm.protocol.frame import Frame

    ident, sid, ctx = NodeIdentity.generate(), uuid.uuid4(), "c" * 32
    chain = [(0, ctx)]

    def commit(step, start, n, inp):
        return step_commit(ident, Frame(sid, step, start, n, 1, "ids", 0, None), inp, "o" * 32, chain, ctx)

    first = commit(1, 0, 5, "a" * 32)
    second = commit(2, 5, 1, "b" * 32)
    assert first["prev"] == ctx and second["prev"] == chain_next(ctx, 0, 5, 0, "a" * 32)
    again = commit(3, 5, 2, "d" * 32)  # rolled back to 5 (a speculative draft dropped): the same history as step 2
    assert again["prev"] == second["prev"]
    inside = commit(4, 6, 1, "e" * 32)  # into step 3: its end's history, cut at 6
    end = chain_next(second["prev"], 5, 2, 0, "d" * 32)
    assert inside["prev"] == context_digest({"prev": end, "cut": 6}) and chain[-1][0] == 7
    assert commit(5, 9, 1, "f" * 32)["prev"] == ""  # a gap: nothing to vouch for
    verify_commit(inside, sid, 4, 6, 1, key_id=ident.key_id)
