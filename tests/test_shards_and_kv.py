"""Shard execution: split invariance, partial loading, the per-session KV cache."""

from __future__ import annotations

import pytest
import torch
from tinymodels import write_tiny_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.local import LocalModel
from ggufswarm.model import load_config
from ggufswarm.runtime.kv import ContextOverflow
from ggufswarm.runtime.shard import ShardExecutor, ShardSpec, split_at


@pytest.fixture(scope="module")
def tiny_gemma(tiny_dir):
    return LocalModel.load(
        write_tiny_model(tiny_dir / "kv-gemma3.gguf", "gemma3", n_layers=6, sliding_window=8), backend="torch"
    )


def _chained(model: LocalModel, points: list[int]) -> list[ShardExecutor]:
    return [ShardExecutor(model.file, spec, config=model.config) for spec in split_at(model.config.n_layers, points)]


def _run(shards, kvs, ids, logits="all"):
    x = torch.tensor(ids)
    for shard, kv in zip(shards, kvs):
        x = shard.forward(kv, x, logits=logits)
    return x


@pytest.mark.parametrize("points", [[1], [3], [2, 4], [1, 2, 3, 4, 5]])
def test_split_invariance_bitwise_tiny(tiny_gemma, points):
    whole = _chained(tiny_gemma, [])
    parts = _chained(tiny_gemma, points)
    kv_w = [s.new_session(64) for s in whole]
    kv_p = [s.new_session(64) for s in parts]
    prompt = list(range(3, 23))  # 20 tokens, longer than the window of 8
    assert torch.equal(_run(whole, kv_w, prompt), _run(parts, kv_p, prompt))
    for tok in (40, 41, 42, 43, 44, 45, 46, 47, 48, 49):  # decode past the window
        assert torch.equal(_run(whole, kv_w, [tok]), _run(parts, kv_p, [tok]))


def test_split_invariance_bitwise_gemma(gemma_torch):
    parts = [ShardExecutor(gemma_torch.file, spec, config=gemma_torch.config) for spec in split_at(18, [6, 12])]
    parts[0].token_embd = gemma_torch.shards[0].token_embd  # share the embedding (same tensor) to save memory
    parts[-1].output = parts[-1].head_weights["output"] = gemma_torch.shards[0].output
    whole = gemma_torch.shards
    ids = gemma_torch.tokenizer.encode("Split invariance: the same logits, bit for bit, from chained shards.")
    kv_w, kv_p = [s.new_session(128) for s in whole], [s.new_session(128) for s in parts]
    assert torch.equal(_run(whole, kv_w, ids), _run(parts, kv_p, ids))
    tok = 1000
    for _ in range(4):
        a, b = _run(whole, kv_w, [tok]), _run(parts, kv_p, [tok])
        assert torch.equal(a, b)
        tok = int(a.argmax())


def test_partial_load_reads_only_the_shard(gemma_path):
    file = GGUFModelFile(gemma_path)
    cfg = load_config(file)
    ShardExecutor(file, ShardSpec(6, 12), config=cfg)
    expected = file.layer_tensor_bytes(6, 12) + file.header_bytes
    print(f"read {file.bytes_read} bytes for blocks 6..11 ({expected} expected, file {gemma_path.stat().st_size})")
    assert file.bytes_read <= 1.1 * expected
    assert file.bytes_read >= file.layer_tensor_bytes(6, 12)


def test_kv_cache_equals_recompute(tiny_gemma):
    ids = list(range(3, 33))  # 30 tokens
    full = tiny_gemma.session(64).logits(ids, all_positions=True)
    session = tiny_gemma.session(64)
    steps = [session.logits(ids[:10], all_positions=True)] + [session.logits([t]) for t in ids[10:]]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-4, atol=1e-4)


def test_kv_cache_equals_recompute_gemma(gemma_torch):
    ids = gemma_torch.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    full = gemma_torch.session(128).logits(ids, all_positions=True)
    session = gemma_torch.session(128)
    steps = [session.logits(ids[:5], all_positions=True)] + [session.logits([t]) for t in ids[5:]]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-3, atol=2e-3)


def test_truncate_then_decode_equals_fresh_session(tiny_gemma):
    a = tiny_gemma.session(64)
    a.logits(list(range(3, 23)))
    a.truncate(12)
    after = a.logits([99])
    fresh = tiny_gemma.session(64)
    fresh.logits(list(range(3, 15)))
    torch.testing.assert_close(after, fresh.logits([99]), rtol=1e-5, atol=1e-5)


def test_interleaved_sessions_are_isolated(tiny_gemma):
    seq_a, seq_b = list(range(3, 20)), list(range(100, 111))
    solo_a = tiny_gemma.session(64).logits(seq_a, all_positions=True)
    solo_b = tiny_gemma.session(64).logits(seq_b, all_positions=True)
    sa, sb = tiny_gemma.session(64), tiny_gemma.session(64)
    out_a, out_b = [sa.logits(seq_a[:3], all_positions=True)], [sb.logits(seq_b[:4], all_positions=True)]
    for i in range(3, len(seq_a)):
        out_a.append(sa.logits([seq_a[i]]))
        if i + 1 < len(seq_b):
            out_b.append(sb.logits([seq_b[i + 1]]))
    torch.testing.assert_close(torch.cat(out_a), solo_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(out_b), solo_b, rtol=1e-4, atol=1e-4)


def test_max_length_cap_and_overflow(tiny_gemma):
    with pytest.raises(ContextOverflow, match="131072"):
        tiny_gemma.shards[0].new_session(131073)
    session = tiny_gemma.session(8)
    with pytest.raises(ContextOverflow, match="max_length 8"):
        session.logits(list(range(3, 12)))
    assert session.kvs[0].length == 0  # nothing was applied
    session.logits(list(range(3, 11)))
    with pytest.raises(ContextOverflow):
        session.logits([5])


def test_bad_inputs_leave_kv_untouched(tiny_gemma):
    shard = ShardExecutor(tiny_gemma.file, ShardSpec(2, 4), config=tiny_gemma.config)
    kv = shard.new_session(16)
    with pytest.raises(ValueError, match="hidden states"):
        shard.forward(kv, torch.zeros(3, 7))
    first = tiny_gemma.shards[0]
    kv0 = first.new_session(16)
    with pytest.raises(ValueError, match="token id out of range"):
        first.forward(kv0, torch.tensor([1, 10**6]))
    assert kv.length == 0 and kv0.length == 0


def test_bfloat16_option_runs(tiny_dir):
    """``dtype="bfloat16"`` (a torch-backend option: llama.cpp computes as llama.cpp does) loads every weight as
    the float32 load's values rounded to bf16, keeps the KV cache in bf16, and computes in it: the logits
    differ from float32's (same top token)."""
    path = write_tiny_model(tiny_dir / "bf16.gguf", "llama")
    model = LocalModel.load(path, dtype="bfloat16", backend="torch")
    ref = LocalModel.load(path, backend="torch")
    for shard, ref_shard in zip(model.shards, ref.shards, strict=True):
        pairs = [(shard.token_embd, ref_shard.token_embd), (shard.output, ref_shard.output)]
        pairs += [
            (w, ref_shard.layers[il][k])
            for il, layer in shard.layers.items()
            for k, w in layer.items()
            if isinstance(w, torch.Tensor)
        ]
        pairs = [(w, r) for w, r in pairs if w is not None]
        assert len(pairs) > 3 * len(shard.layers)
        for w, r in pairs:
            assert w.dtype == torch.bfloat16 and r.dtype == torch.float32
            assert torch.equal(w, r.to(torch.bfloat16))
        assert all(layer.k.dtype == layer.v.dtype == torch.bfloat16 for layer in shard.new_session(8).layers)
    a = model.session(32).logits(list(range(3, 13)))
    b = ref.session(32).logits(list(range(3, 13)))
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert not torch.equal(a, b)
    assert int(a.argmax()) == int(b.argmax())
