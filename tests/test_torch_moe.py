"""The torch reference backend on the tiny mixture-of-experts GGUFs of ``tinymoe`` against llama.cpp on the same file.

``qwen3moe`` (softmax router, renormalised top-2, q/k norms), ``qwen2moe`` (softmax router, top-2 weights not
renormalised, q/k/v biases, a shared expert behind a sigmoid gate) and ``deepseek2`` (MLA with a q LoRA, 3 leading
dense blocks, sigmoid router with a selection bias, normalised and scaled weights, a shared expert): a prompt
and 20 greedy decode steps, one token at a time (so the MLA latent cache is read back at every step), on one
shard and on three (``[0, 2) [2, 4) [4, 6)``: for deepseek2 the first cut falls inside the dense blocks, the
second after them), within the F32 tolerance of ``test_architectures`` (1e-5 of the largest logit).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import llama_cpp_model
from tinymoe import write_tiny_moe_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.model import load_config
from ggufswarm.runtime.shard import ShardExecutor, ShardSpec, split_at

N_DECODE = 20
TOL = 1e-5  # of the largest |logit|: the F32 tolerance of test_architectures.test_logits_match_llama_cpp
SPLITS = {"1-shard": [], "3-shards": [2, 4]}
# name -> (architecture, write_tiny_moe_model overrides)
MODELS = {
    "qwen3moe": ("qwen3moe", {}),
    "qwen2moe": ("qwen2moe", {}),
    "deepseek2": ("deepseek2", {}),
    # DeepSeek-V3 group-limited routing: 4 groups of 2 experts, the experts picked within the best 2 groups
    "deepseek2-groups": ("deepseek2", dict(n_expert_groups=4, n_group_used=2)),
    "deepseek2-lite": ("deepseek2", dict(q_lora_rank=0)),  # DeepSeek-V2-Lite: a plain attn_q, no q LoRA
    # YaRN RoPE scaling as DeepSeek-V3 exports it (factor 40, yarn_log_multiplier 0.1, i.e. mscale_all_dim 1), from
    # an original context of 64 so the blend between extrapolated and interpolated pairs falls inside the 16 dims
    "deepseek2-yarn": ("deepseek2", dict(yarn_factor=40.0, yarn_log_mul=0.1, yarn_orig_ctx=64)),
    # DeepSeek-V2's mscale_all_dim 0.707, and no multiplier at all (ggml's own magnitude 1 + 0.1 ln F stays)
    "deepseek2-yarn-v2": ("deepseek2", dict(yarn_factor=40.0, yarn_log_mul=0.0707, yarn_orig_ctx=64)),
    "deepseek2-yarn-nolog": ("deepseek2", dict(yarn_factor=4.0, yarn_log_mul=0.0, yarn_orig_ctx=16)),
}


def _prompt(n: int = 12, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 384, n - 1).tolist()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """name (of MODELS) -> (path, tokens: prompt + N_DECODE greedy picks, llama.cpp's logits
    ``[len(tokens), n_vocab]``), written and run once per module. llama.cpp evaluates the prompt in one batch, then
    one token per step."""
    out, root = {}, tmp_path_factory.mktemp("tinymoe-torch")

    def get(name: str):
        if name not in out:
            arch, overrides = MODELS[name]
            path = write_tiny_moe_model(root / f"{name}.gguf", arch, **overrides)
            tokens = _prompt()
            llm = llama_cpp_model(path, n_ctx=128)
            try:
                llm.eval(tokens)
                for _ in range(N_DECODE):
                    tokens.append(int(np.argmax(llm.scores[len(tokens) - 1])))
                    llm.eval(tokens[-1:])
                ref = np.array(llm.scores[: len(tokens)])
            finally:
                llm.close()
            out[name] = path, tokens, ref
        return out[name]

    return get


def _torch_logits(path, tokens: list[int], n_prompt: int, cuts: list[int], config=None) -> np.ndarray:
    """The torch backend's logits at every position of ``tokens``: the prompt as one step, then one token per step,
    through the shards cut at ``cuts`` (hidden states passed on), each with its own session."""
    file = GGUFModelFile(path)
    cfg = config or load_config(file)
    shards = [ShardExecutor(file, spec, config=cfg, numerics="llama.cpp") for spec in split_at(cfg.n_layers, cuts)]
    kvs = [s.new_session(128) for s in shards]
    rows = []
    for step in [tokens[:n_prompt]] + [[t] for t in tokens[n_prompt:]]:
        x = torch.tensor(step)
        for shard, kv in zip(shards, kvs):
            x = shard.forward(kv, x, logits="all")
        rows.append(x)
    return torch.cat(rows).numpy()


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("arch", MODELS)
def test_moe_logits_match_llama_cpp(tiny_moe, arch, split):
    path, tokens, ref = tiny_moe(arch)
    t0 = time.perf_counter()
    ours = _torch_logits(path, tokens, len(tokens) - N_DECODE, SPLITS[split])
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    print(
        f"{arch} {split}: max |Δ| {err:.2e} of {scale:.2f} (relative {err / scale:.2e}), "
        f"prompt + {N_DECODE} steps in {time.perf_counter() - t0:.2f} s"
    )
    assert ours.shape == ref.shape == (len(tokens), 384)
    assert err <= TOL * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# A wrong routing setting moves the logits far outside TOL: the comparison above is tight enough to see each.
WRONG_ROUTING = [
    ("qwen3moe", "top-3", dict(n_expert_used=3)),
    ("qwen3moe", "no-renorm", dict(weights_norm=False)),
    ("qwen3moe", "sigmoid", dict(gating="sigmoid")),
    ("qwen2moe", "renorm", dict(weights_norm=True)),
    ("deepseek2", "top-1", dict(n_expert_used=1)),
    ("deepseek2", "softmax", dict(gating="softmax")),
    ("deepseek2", "no-scale", dict(weights_scale=1.0)),
    ("deepseek2", "no-renorm", dict(weights_norm=False)),
    ("deepseek2-groups", "no-groups", dict(n_groups=0, n_group_used=0)),
    ("deepseek2-groups", "3-groups-used", dict(n_group_used=3)),
]


@pytest.mark.parametrize("arch,what,change", WRONG_ROUTING, ids=[f"{a}-{w}" for a, w, _ in WRONG_ROUTING])
def test_wrong_routing_is_detected(tiny_moe, arch, what, change):
    path, tokens, ref = tiny_moe(arch)
    cfg = load_config(GGUFModelFile(path))
    wrong = replace(cfg, moe=replace(cfg.moe, **change))
    ours = _torch_logits(path, tokens, len(tokens) - N_DECODE, [], config=wrong)
    err = np.abs(ours - ref).max()
    print(f"{arch} {what}: max |Δ| {err:.2e}")
    assert err > 100 * TOL * np.abs(ref).max()


DROPPED = [("deepseek2", "exp_probs_b.bias"), ("deepseek2", "ffn_gate_shexp"), ("qwen2moe", "ffn_gate_inp_shexp")]


@pytest.mark.parametrize("arch,tensor", DROPPED, ids=[f"{a}-{t}" for a, t in DROPPED])
def test_selection_bias_and_shared_experts_are_used(tiny_moe, arch, tensor):
    """deepseek2's ``exp_probs_b`` (it picks the experts but does not weight them), its shared expert, and qwen2moe's
    shared-expert gate: dropping one from the torch side's layers (the block then skips that part, as it does for
    a model without it) moves the logits far outside TOL."""
    path, tokens, ref = tiny_moe(arch)
    file = GGUFModelFile(path)
    cfg = load_config(file)
    shard = ShardExecutor(file, ShardSpec(0, cfg.n_layers, True, True), numerics="llama.cpp")
    dropped = [layer.pop(tensor) for layer in shard.layers.values() if tensor in layer]
    assert len(dropped) == cfg.n_layers - cfg.moe.n_dense_lead
    ours = shard.forward(shard.new_session(128), torch.tensor(tokens), logits="all").numpy()
    err = np.abs(ours - ref).max()
    print(f"{arch} without {tensor}: max |Δ| {err:.2e}")
    assert err > 100 * TOL * np.abs(ref).max()


def test_mla_cache_holds_the_latent(tiny_moe):
    """A deepseek2 shard caches ``kv_lora_rank + rope_dim`` values per token and layer (64 + 16 here), no values,
    and advertises that size; truncating the cache and replaying the decode steps gives the same logits."""
    path, tokens, ref = tiny_moe("deepseek2")
    file = GGUFModelFile(path)
    cfg = load_config(file)
    assert (cfg.mla.kv_lora_rank, cfg.mla.rope_dim, cfg.n_head) == (64, 16, 4)
    shard = ShardExecutor(file, ShardSpec(2, 5))
    assert shard.kv_bytes_per_token() == 3 * (64 + 16) * 4
    full = ShardExecutor(file, ShardSpec(0, cfg.n_layers, True, True), numerics="llama.cpp")
    kv = full.new_session(128)
    n_prompt = len(tokens) - N_DECODE
    full.forward(kv, torch.tensor(tokens[:n_prompt]))
    first = [full.forward(kv, torch.tensor([t])) for t in tokens[n_prompt:]]
    assert all(
        tuple(layer.k[: kv.length].shape) == (len(tokens), 1, 80) and layer.v.shape[-1] == 0 for layer in kv.layers
    )
    assert kv.nbytes() == cfg.n_layers * kv.layers[0].k.shape[0] * 80 * 4
    kv.truncate(n_prompt + 5)
    again = [full.forward(kv, torch.tensor([t])) for t in tokens[n_prompt + 5 :]]
    assert all(torch.equal(a, b) for a, b in zip(first[5:], again))
    np.testing.assert_allclose(torch.cat(first).numpy(), ref[n_prompt:], rtol=0, atol=TOL * np.abs(ref).max())


def test_mla_snapshot_round_trip(tiny_moe):
    """A deepseek2 torch session's cache (latent keys, empty values) survives a KV snapshot encode/decode and a
    load into a fresh session: decoding on from it gives the same logits as the original session."""
    from ggufswarm.cache.snapshot import Shard, decode_snapshot, encode_snapshot

    path, tokens, _ = tiny_moe("deepseek2")
    file = GGUFModelFile(path)
    cfg = load_config(file)
    shard = ShardExecutor(file, ShardSpec(0, cfg.n_layers, True, True))
    kv = shard.new_session(128)
    n = len(tokens) - 1
    shard.forward(kv, torch.tensor(tokens[:n]))
    blob = encode_snapshot(
        Shard("0" * 64, 0, cfg.n_layers, "float32"),
        tokens[:n],
        [layer.k[:n] for layer in kv.layers],
        [layer.v[:n] for layer in kv.layers],
    )
    snap = decode_snapshot(blob)
    assert tuple(snap.keys[0].shape) == (n, 1, 80) and tuple(snap.values[0].shape) == (n, 1, 0)
    restored = shard.new_session(128)
    restored.load(snap.keys, snap.values)
    assert torch.equal(shard.forward(restored, torch.tensor(tokens[n:])), shard.forward(kv, torch.tensor(tokens[n:])))


YARN_WRONG = [
    ("no-yarn", lambda cfg: replace(cfg, yarn=None, attn_scale=cfg.head_dim**-0.5)),
    ("no-ramp", lambda cfg: replace(cfg, yarn=replace(cfg.yarn, ext_factor=0.0))),
    ("plain-kq-scale", lambda cfg: replace(cfg, attn_scale=cfg.head_dim**-0.5)),
]


@pytest.mark.parametrize("what,change", YARN_WRONG, ids=[w for w, _ in YARN_WRONG])
def test_yarn_parts_are_each_needed(tiny_moe, what, change):
    """deepseek2's YaRN: without it, without the extrapolation/interpolation blend, or without the ``mscale^2``
    folded into the ``q·k`` scale, the torch side is far outside TOL of llama.cpp."""
    path, tokens, ref = tiny_moe("deepseek2-yarn")
    cfg = load_config(GGUFModelFile(path))
    assert cfg.yarn is not None and cfg.attn_scale > 1.8 * cfg.head_dim**-0.5  # mscale = 1 + 0.1 ln 40
    ours = _torch_logits(path, tokens, len(tokens) - N_DECODE, [], config=change(cfg))
    err = np.abs(ours - ref).max()
    print(f"yarn {what}: max |Δ| {err:.2e}")
    assert err > 100 * TOL * np.abs(ref).max()
