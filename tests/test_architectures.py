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
    ("llama", False, 0), ("qwen2", False, 0), ("qwen3", False, 0),
    ("llama", True, 0), ("qwen2", True, 0), ("qwen3", True, 0),
    ("gemma3", False, 16), ("gemma3", True, 16),
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
    ref = np.array(llm.scores[:len(ids)])
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
    ref = np.array(llm.scores[:len(ids)])
    session = LocalModel.load(path, backend="torch").session(64)
    ours = session.logits(ids, all_positions=True).numpy()
    assert np.abs(ours - ref).max() < 0.02 * np.abs(ref).max()


def test_unsupported_architecture_is_named(tiny_dir):
    path = write_tiny_model(tiny_dir / "llama-as-mamba.gguf", "llama")
    data = bytearray(path.read_bytes())
    idx = data.index(b"general.architecture")
    # the value follows the key: u32 type, u64 length, bytes; "llama" → "mamba" keeps the length
    pos = data.index(b"llama", idx)
    data[pos:pos + 5] = b"mamba"
    bad = tiny_dir / "mamba.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture 'mamba'.*gemma3.*llama.*qwen2.*qwen3"):
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
