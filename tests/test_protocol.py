"""Wire protocol (frames, errors) and the node's session store (budget, TTL, step dedup), without a network."""

from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest
import torch

from ggufswarm.protocol import (
    DTYPE_CODES,
    HEADER,
    HEADER_SIZE,
    FrameError,
    ProtocolError,
    decode_frame,
    encode_hidden,
    encode_tokens,
    frame_size,
)
from ggufswarm.runtime.kv import ContextOverflow
from ggufswarm.runtime.session_state import AdmissionRefused, StepConflict, UnknownSession
from ggufswarm.runtime.sessions import SessionStore

SID = uuid.uuid4()
N_EMBD = 640


def test_header_is_48_bytes_and_decode_frame_fits_budget():
    assert HEADER_SIZE == 48
    # one decode token per hop: f16 row + header + token-id trailer <= 2 * n_embd + 128
    assert frame_size(1, N_EMBD, "f16", token_ids=True) == 48 + 2 * N_EMBD + 4 <= 2 * N_EMBD + 128


@pytest.mark.parametrize("dtype,tol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3)])
def test_hidden_roundtrip(dtype, tol):
    x = torch.randn(5, N_EMBD) * 10
    ids = torch.arange(5)
    body = encode_hidden(SID, 7, 42, x, dtype, ids)
    assert len(body) == frame_size(5, N_EMBD, dtype, token_ids=True)
    f = decode_frame(body, N_EMBD, 16)
    assert (f.session_id, f.step, f.start, f.n_tokens, f.n_embd, f.dtype) == (SID, 7, 42, 5, N_EMBD, dtype)
    assert f.data.dtype == np.float32 and f.data.shape == (5, N_EMBD)
    assert torch.allclose(torch.from_numpy(f.data), x, rtol=tol, atol=0)
    assert f.token_ids.tolist() == ids.tolist() and f.sample


@pytest.mark.parametrize("dtype,torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_wire_rounding_is_torchs_round_to_nearest_even(dtype, torch_dtype):
    """Frames are cast in numpy (bf16 through ml_dtypes), torch-free on llama.cpp nodes: the wire bits equal torch's
    own cast of the same float32 values, ties and subnormals included, from a numpy array or a torch tensor."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(3, N_EMBD, generator=g) * 10 ** torch.randint(-6, 5, (3, 1), generator=g),
            # exact ties between two bf16 / f16 neighbours, and values near the bottom of each range
            (1 + torch.arange(N_EMBD) * 2.0**-10 + 2.0**-24)[None],
            (torch.arange(N_EMBD) * 2.0**-30 - 2.0**-21)[None],
        ]
    ).float()
    want = x.to(torch_dtype).view(torch.int16).numpy().tobytes()
    for given in (x, x.numpy()):
        body = encode_hidden(SID, 1, 0, given, dtype)
        assert body[HEADER_SIZE:] == want


def test_token_roundtrip_and_no_sample_flag():
    body = encode_tokens(SID, 1, 0, [2, 818, 5279], sample=False)
    f = decode_frame(body, N_EMBD, 16)
    assert f.dtype == "ids" and f.data.tolist() == [2, 818, 5279] and f.data.dtype == np.int64
    assert not f.sample and f.token_ids is None


def test_a_quiet_frame_is_the_same_step_to_the_retry_check():
    """FLAG_QUIET (ring decode's quiet steps) reads as ``Frame.quiet``; the retry digest clears it, so the client's
    copy of a quiet step (the bit clear) is the step a node applied quietly, and nothing else is ignored."""
    import zlib

    from ggufswarm.protocol.frame import frame_digest, is_quiet

    sid = uuid.uuid4()
    loud, quiet = encode_tokens(sid, 7, 30, [42]), encode_tokens(sid, 7, 30, [42], quiet=True)
    assert loud != quiet and is_quiet(quiet) and not is_quiet(loud)
    assert decode_frame(quiet).quiet and not decode_frame(loud).quiet
    assert frame_digest(quiet) == frame_digest(loud) == zlib.crc32(loud)
    assert frame_digest(encode_tokens(sid, 7, 30, [43], quiet=True)) != frame_digest(loud)
    assert frame_digest(encode_tokens(sid, 7, 30, [42], sample=False)) != frame_digest(loud)


def test_f16_never_overflows_silently():
    """Gemma's residual stream reaches ~1e5 > f16 max (65504): the frame carries a power-of-two scale."""
    x = torch.tensor([[98538.04, -1.5, 3e-3, 70000.0]])
    f = decode_frame(encode_hidden(SID, 1, 0, x, "f16"), 4)
    assert np.isfinite(f.data).all()
    assert torch.allclose(torch.from_numpy(f.data), x, rtol=1e-3)
    y = torch.tensor([[1.0, 2.0]])
    assert HEADER.unpack_from(encode_hidden(SID, 1, 0, y, "f16"))[4] == 0  # no scale when in range
    with pytest.raises(FrameError) as e:
        encode_hidden(SID, 1, 0, torch.tensor([[float("inf"), 1.0]]), "f16")
    assert e.value.code == "non_finite"


def _raw(**kw):
    fields = dict(
        magic=b"GSWF",
        version=1,
        dtype=DTYPE_CODES["f32"],
        flags=0,
        scale=0,
        sid=SID.bytes,
        step=1,
        start=0,
        n_tokens=1,
        n_embd=4,
        reserved=0,
    )
    fields.update(kw)
    return HEADER.pack(*fields.values())


@pytest.mark.parametrize(
    "body,code",
    [
        (b"", "bad_frame"),
        (b"garbage" * 3, "bad_frame"),
        (b'{"json": true}' + b"\0" * 60, "bad_frame"),
        (_raw(magic=b"XXXX") + b"\0" * 16, "bad_frame"),
        (_raw(version=9) + b"\0" * 16, "unsupported_version"),
        (_raw(dtype=99) + b"\0" * 16, "bad_dtype"),
        (_raw(n_tokens=0), "bad_shape"),
        (_raw(n_embd=8) + b"\0" * 32, "bad_shape"),
        (_raw() + b"\0" * 15, "bad_frame"),
        (_raw() + b"\0" * 17, "bad_frame"),
        (_raw(n_tokens=10**9), "too_many_tokens"),
        (_raw(dtype=DTYPE_CODES["ids"], n_embd=4) + b"\0" * 4, "bad_shape"),
        (_raw() + struct.pack("<4f", 1, float("nan"), 0, 0), "non_finite"),
        (_raw(reserved=7) + b"\0" * 16, "bad_frame"),
    ],
)
def test_bad_frames_are_rejected_with_a_code(body, code):
    with pytest.raises(FrameError) as e:
        decode_frame(body, 4, 4096)
    assert e.value.code == code and e.value.status in (400, 413)
    assert str(e.value)


def test_error_body_is_machine_readable():
    err = ProtocolError("unknown_session", "no such session")
    assert err.status == 404
    assert err.body() == b'{"error": {"code": "unknown_session", "message": "no such session"}}'
    assert ProtocolError("too_many_tokens", "x").status == 413
    assert ProtocolError("kv_budget_full", "x").status == 429
    assert ProtocolError("kv_budget_too_small", "x").status == 503


# -- session store over a one-layer shard ----------------------------------------------------------------


@pytest.fixture(scope="module")
def middle_shard(gemma_path):
    from ggufswarm.artifact.gguf_file import GGUFModelFile
    from ggufswarm.runtime.shard import ShardExecutor, ShardSpec

    return ShardExecutor(GGUFModelFile(gemma_path), ShardSpec(6, 7))


def test_store_admission_control(middle_shard):
    store = SessionStore(middle_shard, budget_tokens=1000, ttl_s=60)
    with pytest.raises(AdmissionRefused) as e:
        store.open(uuid.uuid4(), 1001)
    assert e.value.code == "kv_budget_too_small"
    a = store.open(uuid.uuid4(), 600)
    with pytest.raises(AdmissionRefused) as e:
        store.open(uuid.uuid4(), 600)
    assert e.value.code == "kv_budget_full" and "400 of 1000" in str(e.value)
    store.open(uuid.uuid4(), 400)
    assert store.reserved_tokens == 1000
    store.close(a.id)
    store.open(uuid.uuid4(), 600)
    with pytest.raises(ContextOverflow):
        store.open(uuid.uuid4(), 10**6)
    assert store.kv_bytes_per_token() == 1 * 1 * 256 * 2 * 4


def test_store_refuses_a_session_the_machine_has_no_memory_for(middle_shard):
    """A paged node's store (node.memory.watch_memory) counts what its open sessions may still write, the new
    session's max_length and its buffers' margin against the memory available now: within the budget, a session
    that would not fit in memory is refused as kv_budget_full with the numbers; where the memory is unknown, only the
    budget counts."""
    store = SessionStore(middle_shard, budget_tokens=1000, ttl_s=60)
    per_token, mib = store.kv_bytes_per_token(), 1 << 20
    available = [mib + 700 * per_token]
    store.memory_available, store.memory_margin_bytes = (lambda: available[0]), mib
    a = store.open(uuid.uuid4(), 600)  # 600 tokens not yet written + 1 MiB margin: fits
    with pytest.raises(AdmissionRefused) as e:
        store.open(uuid.uuid4(), 200)  # 800 tokens may be written: not in 700 tokens' memory
    assert e.value.code == "kv_budget_full" and "memory full" in str(e.value)
    assert "may still take 2 MiB" in str(e.value) and "needs 0 MiB" in str(e.value), str(e.value)
    assert store.get(a.id) is a and store.reserved_tokens == 600  # the open session is untouched
    assert store.free_tokens() == 100  # what the advertisement offers: 700 tokens' memory, 600 promised
    available[0] = None  # unknown (not Linux): the budget alone
    store.open(uuid.uuid4(), 400)
    assert store.reserved_tokens == 1000


def test_a_gpu_node_counts_sessions_against_what_its_device_holds_now(middle_shard):
    """A GPU node's KV cache (kv_grows) is counted against what its device's free memory holds at each open
    (node.memory.watch_device), not only at start: VRAM another process takes later makes a session that would not
    fit a kv_budget_full with the numbers, the advertisement offers no more than the device holds, and nothing
    admitted is evicted for it (its cells are in the context already); VRAM given back is offered again."""
    from types import SimpleNamespace

    from ggufswarm.node.memory import evict_for_memory, watch_memory
    from ggufswarm.node.state import NodeConfig

    device = [1000]  # tokens the device holds now (kv_size.device_tokens)
    gpu = SimpleNamespace(kv_grows=True, device_kv_tokens=lambda: device[0])
    store = SessionStore(middle_shard, budget_tokens=2000, ttl_s=60)
    watch_memory(NodeConfig(layers="6:7", model="m"), store, gpu)
    a = store.open(uuid.uuid4(), 600)
    store.apply(a, 1, 1, 0, torch.randn(3, N_EMBD), None)  # 3 of its tokens held: counted once, not twice
    assert store.free_tokens() == 400
    device[0] = 700  # another process took VRAM
    assert store.free_tokens() == 100
    with pytest.raises(AdmissionRefused) as e:
        store.open(uuid.uuid4(), 200)
    assert e.value.code == "kv_budget_full" and "memory full" in str(e.value) and "GPU" in str(e.value)
    store.executor = SimpleNamespace(kv_grows=True)  # (evict_for_memory reads the store's executor)
    assert evict_for_memory(store) == [] and store.get(a.id) is a
    store.executor = middle_shard
    device[0] = 5000  # given back: the budget bounds it again
    assert store.free_tokens() == 1400
    store.open(uuid.uuid4(), 1400)


def test_a_session_the_machine_no_longer_has_memory_for_is_evicted_with_its_reason(middle_shard):
    """When other processes take the memory a paged node's admitted sessions may still write, the node evicts idle
    sessions, the one with the most KV still to write first, until what is committed fits again (and no more): an
    evicted session's next step is refused as unknown_session saying why, the others step on untouched."""
    from ggufswarm.node.memory import evict_for_memory

    store = SessionStore(middle_shard, budget_tokens=1000, ttl_s=60)
    per_token = store.kv_bytes_per_token()
    available = [1000 * per_token]
    store.memory_available = lambda: available[0]
    short, long_, busy = (store.open(uuid.uuid4(), n) for n in (100, 500, 300))
    busy.busy = 1  # in the middle of a step: never evicted
    store.apply(short, 1, 1, 0, torch.randn(3, N_EMBD), None)
    assert evict_for_memory(store) == []  # 897 tokens may still be written, 1000 tokens' memory: fits
    available[0] = 600 * per_token  # another process took memory
    lines = evict_for_memory(store)
    assert len(lines) == 1 and f"evicted session {long_.id} (0 of 500 tokens held)" in lines[0], lines
    with pytest.raises(UnknownSession) as e:
        store.get(long_.id)
    assert "was evicted: the machine's memory no longer holds it" in str(e.value)
    assert store.get(short.id) is short and store.get(busy.id) is busy  # untouched
    rec = store.apply(short, 2, 2, 3, torch.randn(1, N_EMBD), None)
    assert rec.output.shape == (1, N_EMBD) and short.length == 4
    available[0] = 10 * per_token  # only the busy session is left to evict, and it is busy: the short one goes
    assert [str(short.id) in line for line in evict_for_memory(store)] == [True]
    assert list(store.sessions) == [busy.id]
    store.memory_available = None  # memory not watched: nothing is evicted
    assert evict_for_memory(store) == []


def test_a_step_after_its_client_closed_the_session_says_so(middle_shard):
    """A frame of a session its client closed on this node (a stream aborted with a step on its way) is refused as
    session_closed (404), not unknown_session: the client's own closing, nothing to repair, and told apart in the
    node's error counts. An evicted or expired session is still unknown_session."""
    from ggufswarm.net.http import as_protocol_error
    from ggufswarm.runtime.session_state import SessionClosed

    store = SessionStore(middle_shard, budget_tokens=1000, ttl_s=10)
    closed, evicted, expired = (store.open(uuid.uuid4(), 100) for _ in range(3))
    store.close(closed.id)
    for call in (store.get, store.close):
        with pytest.raises(SessionClosed) as e:
            call(closed.id)
        err = as_protocol_error(e.value)
        assert (err.status, err.code) == (404, "session_closed") and "closed by its client" in str(e.value)
    store.evict(evicted.id, "a test")
    store.expire(expired.last_used + 11)
    for sid in (evicted.id, expired.id, uuid.uuid4()):
        with pytest.raises(UnknownSession) as e:
            store.get(sid)
        assert not isinstance(e.value, SessionClosed) and as_protocol_error(e.value).code == "unknown_session"


def test_store_idle_expiry(middle_shard):
    store = SessionStore(middle_shard, budget_tokens=1000, ttl_s=10)
    s = store.open(uuid.uuid4(), 1000)
    assert store.expire(s.last_used + 5) == []
    assert store.expire(s.last_used + 11) == [s.id]
    with pytest.raises(UnknownSession):
        store.get(s.id)
    # an expired session's reservation is free again; expiry is also tried before refusing an open
    s2 = store.open(uuid.uuid4(), 1000)
    s2.last_used -= 11
    store.open(uuid.uuid4(), 1000)


def test_store_step_dedup(middle_shard):
    store = SessionStore(middle_shard, budget_tokens=1000)
    s = store.open(uuid.uuid4(), 100)
    x = torch.randn(3, N_EMBD)
    assert store.replay(s, 1, 111, 0, 3) is None
    rec = store.apply(s, 1, 111, 0, x, None)
    assert s.length == 3 and rec.output.shape == (3, N_EMBD)
    assert store.replay(s, 1, 111, 0, 3) is rec  # identical retry: answered from the record
    assert s.length == 3  # never applied twice
    for step, digest, start, code in [
        (1, 222, 0, "step_conflict"),
        (0, 111, 0, "stale_step"),
        (3, 1, 3, "step_gap"),
        (2, 1, 5, "position_mismatch"),
    ]:
        with pytest.raises(StepConflict) as e:
            store.replay(s, step, digest, start, 1)
        assert e.value.code == code
    with pytest.raises(ContextOverflow):
        store.apply(s, 2, 5, 3, torch.randn(98, N_EMBD), None)
    assert s.length == 3 and s.last is rec  # a failed step changes nothing
    store.truncate(s.id, 1)
    assert s.length == 1 and store.replay(s, 2, 9, 1, 1) is None


def test_store_rewind_and_verify_flags(middle_shard):
    """FLAG_REWIND (speculative decoding): the next step may start inside the previous step only; the node drops the
    tokens from there on first, and the previous step's boundary moves there."""
    from ggufswarm.protocol.frame import FLAG_REWIND, FLAG_VERIFY, decode_frame, encode_tokens

    store = SessionStore(middle_shard, budget_tokens=1000)
    s = store.open(uuid.uuid4(), 100)
    store.apply(s, 1, 1, 0, torch.randn(4, N_EMBD), torch.arange(4))
    store.apply(s, 2, 2, 4, torch.randn(3, N_EMBD), torch.arange(3))  # a verify step: positions 4..6
    assert s.length == 7 and s.boundaries == [4, 7]
    for start in (4, 3, 0):  # not after the previous step's first token: refused, nothing dropped
        with pytest.raises(StepConflict) as e:
            store.replay(s, 3, 3, start, 1, rewind=True)
        assert e.value.code == "position_mismatch" and s.length == 7
    with pytest.raises(StepConflict):  # without the flag a shorter start is a mismatch as before
        store.replay(s, 3, 3, 5, 1)
    assert store.replay(s, 3, 3, 5, 1, rewind=True) is None
    store.apply(s, 3, 3, 5, torch.randn(1, N_EMBD), torch.arange(1))
    assert s.length == 6 and s.boundaries == [4, 5, 6] and s.history == [0, 1, 2, 3, 0, 0]
    frame = decode_frame(encode_tokens(s.id, 4, 6, [1, 2], verify=True, rewind=True))
    assert frame.verify and frame.rewind and frame.sample and frame.flags == FLAG_VERIFY | FLAG_REWIND
    assert not decode_frame(encode_tokens(s.id, 4, 6, [1, 2], sample=False, verify=True)).verify


def test_rewind_past_max_length_is_refused_before_dropping_anything(middle_shard):
    """A rewind step that would end past max_length is refused (context_overflow) in ``replay``, before the rejected
    drafts are dropped: a refused step loses nothing (found by tests/test_fuzz.py: the node held one token less)."""
    store = SessionStore(middle_shard, budget_tokens=1000)
    s = store.open(uuid.uuid4(), 8)
    store.apply(s, 1, 1, 0, torch.randn(8, N_EMBD), torch.arange(8))
    with pytest.raises(ContextOverflow):
        store.replay(s, 2, 2, 7, 2, rewind=True)
    assert s.length == 8 and s.boundaries == [8]
    assert store.replay(s, 2, 2, 7, 1, rewind=True) is None  # a rewind that fits is still taken


def test_ngram_drafter():
    from ggufswarm.client.speculative import NgramDrafter

    d = NgramDrafter(3)
    h = [1, 2, 3, 4, 9, 1, 2]
    assert d.draft(h) == [3, 4, 9]  # "1 2" seen before, followed by 3 4 9
    h += [3]
    assert d.draft(h) == [4, 9, 1]  # the longest match, "1 2 3", wins
    assert d.draft(h, cap=1) == [4]
    h += [7]
    assert d.draft(h) == []  # "7" never seen before
    with pytest.raises(ValueError):
        NgramDrafter(0)
