"""Tiny random-weight GGUFs of every supported architecture against llama.cpp on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import llama_cpp_model
from tinymodels import write_tiny_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.local import LocalModel
from ggufswarm.model import UnsupportedArchitecture, load_config
from ggufswarm.runtime.shard import ShardExecutor, ShardSpec

CASES = [
    # arch, quantized tensors (Q8_0 + Q4_K), gemma3 sliding window
    ("llama", False, 0),
    ("qwen2", False, 0),
    ("qwen3", False, 0),
    ("llama", True, 0),
    ("qwen2", True, 0),
    ("qwen3", True, 0),
    ("gemma3", False, 16),
    ("gemma3", True, 16),
]


def _ids(n: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 384, n - 1).tolist()


@pytest.mark.parametrize("arch,quant,window", CASES, ids=[f"{a}-{'q8_0+q4_k' if q else 'f32'}" for a, q, _ in CASES])
def test_logits_match_llama_cpp(tiny_dir, arch, quant, window):
    path = write_tiny_model(tiny_dir / f"{arch}-{quant}.gguf", arch, quant=quant, sliding_window=window)
    file = GGUFModelFile(path)
    cfg = load_config(file)
    assert cfg.n_head_kv < cfg.n_head  # grouped-query attention
    if quant:
        types = {t.ggml_type.name for t in file.tensors.values()}
        assert {"Q8_0", "Q4_K"} <= types
    ids = _ids(48)  # longer than the gemma3 window of 16: local layers must mask
    llm = llama_cpp_model(path, n_ctx=128)
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)])
    # "llama.cpp" numerics: activations rounded as ggml's CPU kernels do for quantized weights
    shard = ShardExecutor(file, ShardSpec(0, cfg.n_layers, True, True), numerics="llama.cpp")
    ours = shard.forward(shard.new_session(128), torch.tensor(ids), logits="all").numpy()
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    print(f"{arch} quant={quant}: max |Δ| {err:.2e} of {scale:.2f}")
    # Float32 sums in another order can tip an activation across an 8-bit rounding boundary (and,
    # for gemma3, ggml's f16 GELU table): such a flip moves a logit by ~1e-3 of the scale.
    assert err <= (1e-5 if not quant else 2e-3) * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_exact_numerics_close_to_llama_cpp(tiny_dir):
    path = write_tiny_model(tiny_dir / "llama-q-exact.gguf", "llama", quant=True)
    llm = llama_cpp_model(path, n_ctx=128)
    ids = _ids(32)
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)])
    session = LocalModel.load(path, backend="torch").session(64)
    ours = session.logits(ids, all_positions=True).numpy()
    assert np.abs(ours - ref).max() < 0.02 * np.abs(ref).max()


def test_unsupported_architecture_is_named(tiny_dir):
    path = write_tiny_model(tiny_dir / "llama-as-mamba.gguf", "llama")
    data = bytearray(path.read_bytes())
    idx = data.index(b"general.architecture")
    # the value follows the key: u32 type, u64 length, bytes; "llama" → "mamba" keeps the length
    pos = data.index(b"llama", idx)
    data[pos : pos + 5] = b"mamba"
    bad = tiny_dir / "mamba.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(
        UnsupportedArchitecture,
        match="unsupported architecture 'mamba'.*deepseek2, gemma3, llama, qwen2, qwen2moe, qwen3, qwen3moe\\)",
    ):
        load_config(GGUFModelFile(bad))


def test_split_set_loads_like_single_file(tiny_dir):
    single = write_tiny_model(tiny_dir / "one.gguf", "qwen3", seed=3)
    first = write_tiny_model(tiny_dir / "split.gguf", "qwen3", seed=3, split_max_tensors=20)
    a, b = GGUFModelFile(single), GGUFModelFile(first)
    # at most 20 tensors per file: the count of files follows from the single file's own tensor table
    n_files = -(-len(a.tensors) // 20)
    assert n_files > 1
    assert [p.name for p in b.paths] == [f"split-{i:05d}-of-{n_files:05d}.gguf" for i in range(1, n_files + 1)]
    assert first == b.paths[0] and set(a.tensors) == set(b.tensors)
    ids = _ids(20)
    la = LocalModel.load(single, backend="torch").session(64).logits(ids, all_positions=True)
    lb = LocalModel.load(first, backend="torch").session(64).logits(ids, all_positions=True)
    assert torch.equal(la, lb)


def _torch_and_llama_cpp(path, ids: list[int], split: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the torch backend's logits at every position, llama.cpp's on the same file) for ``ids``. With ``split``,
    the torch side is two shards, ``[0, split)`` + embedding and ``[split, n)`` + head, hidden states passed on."""
    llm = llama_cpp_model(path, n_ctx=128)
    try:
        llm.eval(ids)
        ref = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    file = GGUFModelFile(path)
    n = load_config(file).n_layers
    specs = (
        [ShardSpec(0, split, embed=True), ShardSpec(split, n, head=True)] if split else [ShardSpec(0, n, True, True)]
    )
    x = torch.tensor(ids)
    for spec in specs:
        shard = ShardExecutor(file, spec, numerics="llama.cpp")
        x = shard.forward(shard.new_session(128), x, logits="all")
    return x.numpy(), ref


ROPE_CASES = [
    # arch, write_tiny_model options shared by the plain and the varied model, the RoPE option under test
    ("llama", {}, {"rope_linear_factor": 4.0}),
    ("qwen3", {}, {"rope_linear_factor": 4.0}),  # NeoX pairs
    # Gemma 3 (4B and up) style: the global layer (5) is scaled, the sliding-window layers 0-4 are not
    ("gemma3", {"n_layers": 6, "sliding_window": 16}, {"rope_linear_factor": 8.0}),
    ("llama", {}, {"rope_freqs": True}),  # llama 3.1: per-dimension frequency divisors, rope_freqs.weight
    # as llama.cpp reads them: a factor without a type is linear; the legacy key rope.scale_linear
    ("llama", {}, {"rope_linear_factor": 4.0, "rope_scaling_style": "untyped"}),
    ("llama", {}, {"rope_linear_factor": 4.0, "rope_scaling_style": "legacy"}),
]


def test_unimplemented_rope_scaling_is_refused_on_torch(tiny_dir):
    """A RoPE scaling type the torch backend does not implement (YaRN) is refused by name, not ignored (ignoring
    it would give logits that silently differ from llama.cpp's)."""
    path = write_tiny_model(
        tiny_dir / "yarn.gguf", "llama", n_layers=2, rope_linear_factor=4.0, rope_scaling_style="yarn"
    )
    with pytest.raises(UnsupportedArchitecture, match="'yarn'.*--backend llama.cpp"):
        load_config(GGUFModelFile(path))


@pytest.mark.parametrize(
    "arch,shared,option", ROPE_CASES, ids=[f"{a}-{'-'.join(map(str, o.values()))}" for a, _, o in ROPE_CASES]
)
def test_rope_scaling_and_freq_factors_match_llama_cpp(tiny_dir, arch, shared, option):
    """Linear RoPE scaling (``rope.scaling.type = linear``, ``rope.scaling.factor``) and ``rope_freqs.weight``:
    the torch backend's logits are llama.cpp's on the same F32 file (the tolerance of test_logits_match_llama_cpp),
    on one shard and on two (the second, without the embedding, still applies them); and the option is not
    ignored: the same weights without it give logits far outside that tolerance (on both sides). The scaling is
    also read as llama.cpp reads it from a factor without a type (linear) and from the legacy rope.scale_linear."""
    tag = "-".join(f"{k}{v}" for k, v in option.items())
    plain = write_tiny_model(tiny_dir / f"rope-{arch}-{len(shared)}-plain.gguf", arch, **shared)
    varied = write_tiny_model(tiny_dir / f"rope-{arch}-{len(shared)}-{tag}.gguf", arch, **shared, **option)
    ids = _ids(48)
    ours, ref = _torch_and_llama_cpp(varied, ids)
    split_ours, _ = _torch_and_llama_cpp(varied, ids, split=2)
    plain_ours, plain_ref = _torch_and_llama_cpp(plain, ids)
    scale = np.abs(ref).max()
    tol = 1e-5 * scale
    err, split_err = np.abs(ours - ref).max(), np.abs(split_ours - ref).max()
    moved = np.abs(ref - plain_ref).max()
    print(f"{arch} {option}: max |Δ| {err:.2e} (split {split_err:.2e}) of {scale:.2f}; without it {moved:.2f} away")
    assert err <= tol and split_err <= tol
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # position 0 is not rotated at all; every later one is, differently with the option
    assert np.abs(ref[0] - plain_ref[0]).max() <= tol
    assert moved > 100 * tol and np.abs(ours - plain_ours).max() > 100 * tol
    assert np.abs(plain_ours - plain_ref).max() <= 1e-5 * np.abs(plain_ref).max()


def test_final_logit_softcap_matches_llama_cpp(tiny_dir):
    """``gemma3.final_logit_softcapping`` (the head computes ``cap * tanh(logits / cap)``): the torch backend's
    logits are llama.cpp's on the same F32 file, within the tolerance of the uncapped model's logits (tanh only
    shrinks differences), and far from the uncapped ones: the cap is not ignored by either."""
    cap = 10.0  # the uncapped logits: median |x| ~5, max ~130: most are in tanh's bend, the largest saturate
    plain = write_tiny_model(tiny_dir / "softcap-plain.gguf", "gemma3", sliding_window=16)
    capped = write_tiny_model(tiny_dir / "softcap-10.gguf", "gemma3", sliding_window=16, final_logit_softcap=cap)
    ids = _ids(48)
    ours, ref = _torch_and_llama_cpp(capped, ids)
    plain_ours, plain_ref = _torch_and_llama_cpp(plain, ids)
    tol = 1e-5 * np.abs(plain_ref).max()
    err = np.abs(ours - ref).max()
    print(f"softcap {cap}: max |Δ| {err:.2e} (tolerance {tol:.2e}); uncapped max {np.abs(plain_ref).max():.1f}")
    assert np.abs(plain_ours - plain_ref).max() <= tol
    assert err <= tol
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(ref).max() <= cap and np.abs(ours).max() <= cap
    assert np.abs(ref - plain_ref).max() > cap and np.abs(ours - plain_ours).max() > cap
    # the curve itself, not just some squashing: llama.cpp's capped logits are cap * tanh(uncapped / cap)
    np.testing.assert_allclose(ref, cap * np.tanh(plain_ref / cap), rtol=0, atol=tol)
