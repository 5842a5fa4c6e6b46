"""Prefix KV snapshots: the content-addressed store (prefix index, LRU, hash checks) and node snapshot/restore."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch
from apphost import AppThread
from route_fixtures import http, open_greedy
from tinymodels import write_tiny_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.cache.app import CacheConfig
from ggufswarm.cache.app import make_app as make_cache_app
from ggufswarm.cache.snapshot import (
    BLOCK_TOKENS,
    STATE_DTYPE,
    Shard,
    SnapshotError,
    decode_snapshot,
    encode_snapshot,
    snapshot_key,
)
from ggufswarm.cache.store import SnapshotCorrupt, SnapshotExists, SnapshotMissing, SnapshotStore
from ggufswarm.client.repair import common_prefix
from ggufswarm.node.app import make_app as make_node_app
from ggufswarm.node.snapshots import grouped_length
from ggufswarm.node.state import NodeConfig
from ggufswarm.protocol import encode_tokens

SHARD = Shard("ab" * 32, 0, 2, "float32")


def blob_for(tokens, shard=SHARD, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    keys = [torch.randn(n, 1, 8, generator=g) for _ in range(shard.end - shard.start)]
    values = [torch.randn(n, 1, 8, generator=g) for _ in range(shard.end - shard.start)]
    return encode_snapshot(shard, tokens, keys, values), keys, values


def test_snapshot_round_trip_and_rejects():
    tokens = list(range(40))
    blob, keys, values = blob_for(tokens)
    snap = decode_snapshot(blob)
    assert snap.shard == SHARD and snap.tokens.tolist() == tokens and snap.key == snapshot_key(SHARD, tokens)
    assert all(torch.equal(a, b) for a, b in zip(snap.keys + snap.values, keys + values))
    for bad in (b"", b"garbage" * 10, blob[:100]):
        with pytest.raises(SnapshotError):
            decode_snapshot(bad)
    assert snap.boundaries == []
    # a llama.cpp state with the step boundaries of the computation that made it
    state = Shard("cd" * 32, 0, 2, STATE_DTYPE)
    snap = decode_snapshot(encode_snapshot(state, tokens, [], [], b"\1\2\3", boundaries=[32, 33, 40]))
    assert snap.boundaries == [32, 33, 40] and snap.state == b"\1\2\3"
    for bad in ([0, 40], [33, 32], [32, 32], [41]):
        with pytest.raises(SnapshotError, match="boundaries"):
            encode_snapshot(state, tokens, [], [], b"\1", boundaries=bad)


def test_signed_snapshots_verify_and_forgeries_are_refused(tmp_path):
    """A node signs the snapshots it takes (its key in ``node``, ``sig`` over the content digest): the signature
    verifies after the round trip; a blob whose content or signature was changed is refused by the cache; an
    unsigned one is reported unsigned (a restoring node then does not use it)."""
    from ggufswarm.net.identity import NodeIdentity

    ident, state = NodeIdentity.generate(), Shard("cd" * 32, 0, 2, STATE_DTYPE)
    tokens = list(range(40))
    signed = decode_snapshot(encode_snapshot(state, tokens, [], [], b"\1\2\3", boundaries=[40], identity=ident))
    assert signed.node == ident.key_id and signed.check_signature() is True
    assert decode_snapshot(encode_snapshot(state, tokens, [], [], b"\1\2\3")).check_signature() is False
    torch_signed = decode_snapshot(encode_snapshot(SHARD, tokens, *blob_for(tokens)[1:], identity=ident))
    assert torch_signed.check_signature() is True
    store = SnapshotStore(tmp_path / "c", max_bytes=2**24)
    forged = encode_snapshot(state, tokens, [], [], b"\1\2\4", boundaries=[40], identity=ident)
    forged = forged.replace(b"\1\2\4", b"\1\2\5")  # the state changed after signing
    with pytest.raises(SnapshotError, match="signature"):
        store.put(forged)
    other = NodeIdentity.generate()  # a signature by someone else, under the first node's name
    blob = encode_snapshot(state, tokens, [], [], b"\1\2\3", boundaries=[40], identity=other)
    with pytest.raises(SnapshotError, match="signature"):
        store.put(blob.replace(other.key_id.encode(), ident.key_id.encode()))
    assert store.put(encode_snapshot(state, tokens, [], [], b"\1\2\3", boundaries=[40], identity=ident))["key"]


def test_restorable_length_follows_the_steps():
    """A llama.cpp snapshot restores to its last step boundary inside the shared prefix; for a repair, to the
    last one where its steps and the session's agree. A route keeps the longest prefix all nodes restored with
    the same steps (torch nodes report no steps: only their length counts)."""
    bounds = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    assert grouped_length(bounds, 45) == 45 and grouped_length(bounds, 39) == 0 and grouped_length(bounds, 60) == 48
    assert grouped_length(bounds, 47, [40, 41, 42, 43, 44, 45, 46, 47]) == 47
    assert grouped_length(bounds, 47, [40, 41, 43, 47]) == 41  # the session's third step ended elsewhere
    assert grouped_length(bounds, 47, [20, 47]) == 0
    common = common_prefix
    assert common({"a": (45, [40, 44, 45]), "b": (44, [40, 44])}) == (44, [40, 44])
    assert common({"a": (45, [40, 44, 45]), "b": (45, [40, 43, 45])}) == (40, [40])
    assert common({"a": (45, [40, 44, 45]), "t": (42, None)}) == (40, [40])
    assert common({"t": (42, None), "u": (30, None)}) == (30, [])
    assert common({"a": (0, []), "b": (45, [45])}) == (0, [])


def test_store_prefix_lookup_supersede_lru_and_corruption(tmp_path):
    store = SnapshotStore(tmp_path / "c", max_bytes=10**6)
    a = list(range(100, 140))  # 40 tokens: 2 whole blocks
    info = store.put(blob_for(a)[0])
    assert info["blocks"] == 40 // BLOCK_TOKENS and info["n_tokens"] == 40
    assert store.lookup(SHARD, a + [1, 2, 3]) == (info["key"], 32)
    assert store.lookup(SHARD, a[:20] + [7] * 30) == (info["key"], 16)  # diverges inside block 2
    assert store.lookup(SHARD, [7] + a) is None
    assert store.lookup(Shard(SHARD.model, 0, 2, "bfloat16"), a) is None  # other dtype, other address
    assert store.lookup(Shard(SHARD.model, 2, 4, "float32"), a) is None  # other layers
    other_model = ("0" if SHARD.model[0] != "0" else "1") + SHARD.model[1:]
    assert store.lookup(Shard(other_model, SHARD.start, SHARD.end, SHARD.dtype), a) is None  # other model (GGUF)
    # the first blob under a key stays: the same bytes again are a no-op, other bytes are refused
    again = store.put(blob_for(a)[0])
    assert again["key"] == info["key"] and again["existing"] and store.count == 1
    with pytest.raises(SnapshotExists, match="first upload stays"):
        store.put(blob_for(a, seed=1)[0])
    assert decode_snapshot(store.get(info["key"])).content_digest() == decode_snapshot(blob_for(a)[0]).content_digest()
    assert store.stats.refused == 1
    # a longer snapshot of the same tokens takes over every block: the older blob is deleted
    longer = store.put(blob_for(a + list(range(24)))[0])
    assert store.count == 1 and store.lookup(SHARD, a + list(range(24))) == (longer["key"], 64)
    with pytest.raises(SnapshotMissing):
        store.get(info["key"])
    # LRU under the size cap: the least recently read snapshot goes first
    size = len(blob_for(list(range(32)))[0])
    small = SnapshotStore(tmp_path / "lru", max_bytes=2 * size + 10)
    k1 = small.put(blob_for([1] * 32)[0])["key"]
    k2 = small.put(blob_for([2] * 32)[0])["key"]
    small.get(k1)
    k3 = small.put(blob_for([3] * 32)[0])
    assert k3["evicted"] == [k2] and small.count == 2 and small.stats.evictions == 1
    # bytes changed on disk fail the SHA-256 check on read: deleted, reported as corrupt
    path = small.path(k1)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorrupt):
        small.get(k1)
    assert small.count == 1 and small.lookup(SHARD, [1] * 32) is None
    # shorter than a block, or not a snapshot: refused
    with pytest.raises(SnapshotError):
        store.put(blob_for([1] * (BLOCK_TOKENS - 1))[0])
    with pytest.raises(SnapshotError):
        store.put(b"not a snapshot")
    # the index survives a restart
    store.close()
    again = SnapshotStore(tmp_path / "c", max_bytes=10**6)
    assert again.lookup(SHARD, a) == (longer["key"], 32)


def test_cache_server_http(tmp_path):
    with AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path), max_bytes=10**6))) as url:
        blob = blob_for(list(range(48)))[0]
        req = urllib.request.Request(url + "/v1/snapshots", data=blob, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            info = json.loads(r.read())
            assert r.status == 201 and info["blocks"] == 3
        with urllib.request.urlopen(f"{url}/v1/snapshots/{info['key']}", timeout=10) as r:
            assert r.read() == blob
        status, found = http(
            "POST",
            url + "/v1/lookup",
            {"model": SHARD.model, "layers": [0, 2], "dtype": "float32", "tokens": list(range(40))},
        )
        assert status == 200 and found == {"key": info["key"], "length": 32}
        assert http("GET", f"{url}/v1/snapshots/{'0' * 64}")[0] == 404
        assert http("GET", f"{url}/v1/snapshots/nothex")[1]["error"]["code"] == "bad_request"
        assert http("POST", url + "/v1/snapshots", b"junk")[1]["error"]["code"] == "bad_snapshot"
        for body in (
            {},
            {"model": "x", "layers": [0, 2], "dtype": "float32", "tokens": []},
            {"model": SHARD.model, "layers": [2, 0], "dtype": "float32", "tokens": []},
            {"model": SHARD.model, "layers": [0, 2], "dtype": "float32", "tokens": [-1]},
        ):
            assert http("POST", url + "/v1/lookup", body)[0] == 400
        h = http("GET", url + "/health")[1]
        assert h["snapshots"] == 1 and h["hits"] == 1


def step(url, sid, step_no, start, ids, sample=True):
    return http("POST", url + "/v1/step", encode_tokens(sid, step_no, start, ids, sample))


def test_node_snapshots_and_restores(tiny_dir, tmp_path):
    """torch backend: a node with --cache snapshots after prefill and every N tokens; a new session restores
    the longest cached prefix and continues exactly as one that computed it."""
    model = write_tiny_model(tiny_dir / "cache-llama.gguf", "llama", n_layers=2)
    with (
        AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path), max_bytes=10**8))) as cache,
        AppThread(
            lambda: make_node_app(
                NodeConfig(
                    layers="0:2",
                    embed=True,
                    head=True,
                    model=str(model),
                    cache=cache,
                    snapshot_every=8,
                    backend="torch",
                )
            )
        ) as node,
    ):
        prompt = [5 + (i * 7) % 300 for i in range(40)]
        a = open_greedy(node)
        status, first = step(node, a, 1, 0, prompt)
        assert status == 200
        tokens = prompt + [first["token"]]
        n_step = 1
        for _ in range(10):  # 40 + 10 decode steps: snapshots after prefill (40) and at 48
            n_step += 1
            status, reply = step(node, a, n_step, len(tokens) - 1, [tokens[-1]])
            tokens.append(reply["token"])
        deadline = time.monotonic() + 30
        while http("GET", node + "/health")[1]["snapshots"]["written"] < 2 and time.monotonic() < deadline:
            # one snapshot per session is in flight at a time: on a loaded machine the first may still be uploading
            # when the session passes 48, and the next is taken at the next step past a multiple of 8
            if len(tokens) < 90:
                n_step += 1
                status, reply = step(node, a, n_step, len(tokens) - 1, [tokens[-1]])
                tokens.append(reply["token"])
            time.sleep(0.05)
        h = http("GET", node + "/health")[1]
        assert h["snapshots"]["written"] >= 2 and h["snapshots"]["failed"] == 0
        assert http("GET", cache + "/health")[1]["snapshots"] == 1  # the later snapshot took over the first

        # a new session whose prompt shares 45 tokens: the index finds 32 (whole blocks), the snapshot holds
        # them all; restore all but the last (it is computed and sampled)
        b = open_greedy(node)
        status, restored = http("POST", f"{node}/v1/sessions/{b}/restore", {"tokens": tokens[:44], "step": 0})
        assert status == 200 and restored["length"] == 44, restored
        status, got = step(node, b, 1, 44, tokens[44:45])
        c = open_greedy(node)
        status, want = step(node, c, 1, 0, tokens[:45])
        assert got["token"] == want["token"]
        for (ta, la), (tb, lb) in zip(got["logprobs"], want["logprobs"]):
            assert ta == tb and abs(la - lb) < 1e-4
        # restoring into a session that holds tokens is refused; bad ids are refused; the node keeps serving
        assert (
            http("POST", f"{node}/v1/sessions/{b}/restore", {"tokens": tokens})[1]["error"]["code"]
            == "session_not_empty"
        )
        d = open_greedy(node)
        assert http("POST", f"{node}/v1/sessions/{d}/restore", {"tokens": [10**6] * 20})[0] == 400
        assert http("POST", f"{node}/v1/sessions/{d}/restore", {"tokens": "x"})[0] == 400
        # a miss restores nothing
        status, miss = http("POST", f"{node}/v1/sessions/{d}/restore", {"tokens": [3] * 40})
        assert status == 200 and miss["length"] == 0


def test_llama_cpp_node_restores_any_session_at_step_boundaries(tiny_dir, tmp_path):
    """llama.cpp backend: a snapshot (a llama.cpp sequence state) carries the steps that computed it and is
    restored, into any session, only up to one of them: there the KV is exactly what llama.cpp left after
    those steps, so a session continuing from it answers bit for bit as the one that took it. A prefix that
    ends inside a step restores nothing; a repair (``boundaries``) restores only as far as the steps agree."""
    model = write_tiny_model(tiny_dir / "cache-llama.gguf", "llama", n_layers=2)
    with (
        AppThread(lambda: make_cache_app(CacheConfig(dir=str(tmp_path), max_bytes=10**8))) as cache,
        AppThread(
            lambda: make_node_app(
                NodeConfig(
                    layers="0:2",
                    embed=True,
                    head=True,
                    model=str(model),
                    cache=cache,
                    snapshot_every=8,
                    data_dir=str(tmp_path),
                )
            )
        ) as node,
    ):
        assert http("GET", node + "/health")[1]["backend"] == "llama.cpp"
        prompt = [5 + (i * 7) % 300 for i in range(40)]
        a = open_greedy(node)
        status, first = step(node, a, 1, 0, prompt)
        tokens, replies = prompt + [first["token"]], [first]
        for i in range(10):  # steps end at 40, 41, ..., 50; snapshots after the prefill (40) and at 48
            status, reply = step(node, a, 2 + i, len(tokens) - 1, [tokens[-1]])
            tokens.append(reply["token"])
            replies.append(reply)
        deadline = time.monotonic() + 20
        while http("GET", node + "/health")[1]["snapshots"]["written"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http("GET", node + "/health")[1]["snapshots"]["written"] >= 2
        # another session sharing 45 tokens restores all of them (45 is where a decode step ended) and continues
        # exactly as session a did from there
        b = open_greedy(node)
        status, restored = http("POST", f"{node}/v1/sessions/{b}/restore", {"tokens": tokens[:45], "step": 0})
        assert status == 200 and restored["length"] == 45 and restored["boundaries"] == list(range(40, 46))
        status, again = step(node, b, 1, 45, [tokens[45]])
        assert again["token"] == replies[6]["token"] and again["logprobs"] == replies[6]["logprobs"]
        http("DELETE", f"{node}/v1/sessions/{b}")
        found = http(
            "POST",
            cache + "/v1/lookup",
            {"model": GGUFModelFile(model).fingerprint, "layers": [0, 2], "dtype": STATE_DTYPE, "tokens": tokens[:48]},
        )[1]
        with urllib.request.urlopen(f"{cache}/v1/snapshots/{found['key']}", timeout=10) as resp:
            stored = decode_snapshot(resp.read())
        shard, real_state = stored.shard, stored.state
        assert stored.node == http("GET", node + "/health")[1]["node_id"] and stored.boundaries == list(range(40, 49))
        # nobody can replace a snapshot others restore: an upload of other bytes under the same key is refused
        poisoned = encode_snapshot(
            shard, tokens[:48], [], [], bytes(len(real_state)), boundaries=list(range(40, 49)), node="intruder"
        )
        status, refused = http("POST", cache + "/v1/snapshots", poisoned)
        assert (
            status == 409
            and refused["error"]["code"] == "snapshot_exists"
            and "intruder" in refused["error"]["message"]
        )
        e = open_greedy(node)
        assert http("POST", f"{node}/v1/sessions/{e}/restore", {"tokens": tokens[:45]})[1]["length"] == 45
        assert step(node, e, 1, 45, [tokens[45]])[1]["logprobs"] == replies[6]["logprobs"]
        http("DELETE", f"{node}/v1/sessions/{e}")
        # a prompt sharing only 38 tokens: no step of the snapshot ends inside them (the prefill ran to 40)
        c = open_greedy(node)
        status, none = http("POST", f"{node}/v1/sessions/{c}/restore", {"tokens": prompt[:38] + [1, 2, 3]})
        assert status == 200 and none["length"] == 0 and "step" in none["reason"]
        # a repair names its own steps: restored only as far as they agree with the snapshot's
        for own, want in (([40, 41, 42, 43, 44, 45, 46, 47], 47), ([40, 41, 43, 47], 41), ([20, 47], 0)):
            d = open_greedy(node)
            status, got = http("POST", f"{node}/v1/sessions/{d}/restore", {"tokens": tokens[:47], "boundaries": own})
            assert status == 200 and got["length"] == want, (own, got)
            http("DELETE", f"{node}/v1/sessions/{d}")
        status, bad = http("POST", f"{node}/v1/sessions/{c}/restore", {"tokens": tokens[:47], "boundaries": [41, 40]})
        assert status == 400 and bad["error"]["code"] == "bad_request"
        assert http("GET", node + "/health")[0] == 200


def test_restore_without_a_reachable_cache_recomputes(tiny_dir):
    model = write_tiny_model(tiny_dir / "cache-llama.gguf", "llama", n_layers=2)
    with AppThread(
        lambda: make_node_app(
            NodeConfig(layers="0:2", embed=True, head=True, model=str(model), cache="http://127.0.0.1:9")
        )
    ) as node:
        sid = open_greedy(node)
        status, body = http("POST", f"{node}/v1/sessions/{sid}/restore", {"tokens": list(range(40))})
        assert status == 200 and body["length"] == 0 and "cache failed" in body["reason"]
        assert step(node, sid, 1, 0, list(range(40)))[0] == 200


def test_store_refuses_poisoned_snapshots_and_handles_its_directory(tmp_path):
    store = SnapshotStore(tmp_path / "c", max_bytes=10**6)
    tokens = list(range(32))
    keys = [torch.zeros(32, 1, 8), torch.full((32, 1, 8), float("nan"))]
    with pytest.raises(SnapshotError, match="NaN"):
        store.put(encode_snapshot(SHARD, tokens, keys, [torch.zeros(32, 1, 8), torch.zeros(32, 1, 8)]))
    with pytest.raises(SnapshotError, match="non-negative"):
        store.put(blob_for([-1] + tokens[1:])[0])
    with pytest.raises(SnapshotError, match="fingerprint"):
        store.put(blob_for(tokens, Shard("not-hex", 0, 2, "float32"))[0])
    with pytest.raises(SnapshotError, match="holds at most"):
        SnapshotStore(tmp_path / "tiny", max_bytes=100).put(blob_for(tokens)[0])
    for i in range(3):
        store.put(blob_for([i] * 32)[0])
    store.close()
    smaller = SnapshotStore(tmp_path / "c", max_bytes=len(blob_for([0] * 32)[0]) + 10)  # restarted with a lower cap
    assert smaller.count == 1 and smaller.total_bytes <= smaller.max_bytes
    assert sum(1 for p in (tmp_path / "c").iterdir() if p.is_dir()) == 1  # emptied subfolders are removed
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        SnapshotStore(tmp_path / "file", max_bytes=10)


def test_cache_server_limits(tmp_path):
    config = CacheConfig(dir=str(tmp_path), max_bytes=2000, max_upload_bytes=4096)
    with AppThread(lambda: make_cache_app(config)) as url:
        status, body = http("POST", url + "/v1/snapshots", b"\0" * 5000)
        assert status == 413 and body["error"]["code"] == "snapshot_too_large"
        status, body = http("POST", url + "/v1/snapshots", blob_for(list(range(32)))[0])
        assert status == 413 and body["error"]["code"] == "snapshot_too_large"  # bigger than the whole cache
        req = urllib.request.Request(
            url + "/v1/lookup", data=b"[" * 100000, method="POST", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 413  # over max_upload_bytes before it is even parsed
        req = urllib.request.Request(
            url + "/v1/lookup", data=b"{}", method="POST", headers={"Content-Type": "application/json; charset=bogus"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and json.loads(err.value.read())["error"]["code"] == "bad_request"
        assert http("GET", url + "/health")[0] == 200
