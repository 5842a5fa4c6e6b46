"""The real model (Gemma 3 270M Q4_K_M) against llama.cpp, computed in the same run via llama-cpp-python.

The torch backend (exact dequantized weights) is judged against llama.cpp on the same file
dequantized to F32 by llama.cpp (``llama_model_quantize``): what the GGUF means without the 8-bit
activation rounding of llama.cpp's quantized kernels. Top-1 ≥ 98%, perplexity within 1%, greedy
tokens equal for 9 of 10 prompts. (The quantized kernels themselves are the llama.cpp backend's,
bitwise: tests/test_llamacpp_backend.py.) Perplexity on both backends is checked against
``llama-perplexity``'s own figure.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from route_fixtures import greedy_prompts

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.runtime.sampling import SamplingParams

DATA = Path(__file__).parent / "data"


def _nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """NLL (nats) of ids[1:] from logits[:-1], in float64, 200 rows at a time (a row is 262144 wide)."""
    out = []
    for i in range(0, len(ids) - 1, 200):
        logp = torch.log_softmax(torch.from_numpy(logits[i:min(i + 200, len(ids) - 1)]).double(), dim=-1)
        out.append(-logp.gather(1, torch.tensor(ids[i + 1:i + 1 + logp.shape[0]])[:, None])[:, 0].numpy())
    return np.concatenate(out)


def _llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


@pytest.fixture(scope="module")
def teacher_forced(gemma_torch, reference_text):
    ids = gemma_torch.tokenizer.encode(reference_text)[:1600]
    assert len(ids) >= 1500
    session = gemma_torch.session(len(ids))  # in steps of 400 tokens: the 262144-wide logits stay small
    return ids, np.concatenate([session.logits(ids[i:i + 400], all_positions=True).numpy()
                                for i in range(0, len(ids), 400)])


def test_dequantization_equals_llama_cpp(gemma_path, gemma_f32_path):
    ours, ref = GGUFModelFile(gemma_path), GGUFModelFile(gemma_f32_path)
    assert set(ours.tensors) == set(ref.tensors)
    for name in ours.tensors:
        assert np.array_equal(ours.read_tensor(name), ref.read_tensor(name)), name


def _compare(label: str, ids: list[int], ours: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, float]:
    """Top-1 agreement per position and perplexity ratio (ours / reference), printed."""
    agree = ours.argmax(-1) == ref.argmax(-1)
    ppl_ours, ppl_ref = math.exp(_nll(ours, ids).mean()), math.exp(_nll(ref, ids).mean())
    print(f"vs {label}: top-1 {agree.mean():.4f} (past 512: {agree[512:].mean():.4f}), "
          f"ppl {ppl_ours:.4f} vs {ppl_ref:.4f}, max |Δlogit| {max(np.abs(a - b).max() for a, b in zip(ours, ref)):.4f}")
    return agree, ppl_ours / ppl_ref


def test_teacher_forced_vs_llama_cpp_f32(teacher_forced, gemma_f32_llama_cpp):
    ids, ours = teacher_forced
    agree, ratio = _compare("llama.cpp F32", ids, ours, _llama_cpp_logits(gemma_f32_llama_cpp, ids))
    assert agree.mean() >= 0.98
    assert agree[512:].mean() >= 0.98
    assert abs(ratio - 1) < 0.01


def llama_cpp_greedy(llm, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from llama.cpp: argmax of its logits, fed back one at a time."""
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def test_greedy_tokens_match_llama_cpp(gemma_torch, gemma_f32_llama_cpp, reference_text):
    prompts = greedy_prompts(reference_text)
    assert len(gemma_torch.tokenizer.encode(prompts[-1])) > 600
    matches = []
    for prompt in prompts:
        ids = gemma_torch.tokenizer.encode(prompt)
        session = gemma_torch.session(len(ids) + 16, SamplingParams(temperature=0))
        ours = [session.step(ids)]
        while len(ours) < 16:
            ours.append(session.step([ours[-1]]))
        ref = llama_cpp_greedy(gemma_f32_llama_cpp, ids, 16)
        matches.append(ours == ref)
        print(f"{'ok  ' if ours == ref else 'DIFF'} {prompt[:30]!r}: {gemma_torch.tokenizer.decode(ours)!r}")
    assert sum(matches) >= 9, matches


def _cli_perplexity(ggufswarm_cli, *args: str) -> float:
    out = subprocess.run([*ggufswarm_cli, "perplexity", str(DATA / "gpl-3.0-excerpt.txt"), "--ctx-size", "256",
                          "--split", "9", *args], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("perplexity: ")
    return float(last.split()[-1])


def _llama_perplexity_figure(ctx_size: int) -> float:
    """``llama-perplexity``'s own final estimate on the same text (a fixture: tests/data/llama_perplexity_gemma.json,
    made by tests/data/make_llama_perplexity_fixture.sh with the llama.cpp that llama-cpp-python bundles)."""
    runs = json.loads((DATA / "llama_perplexity_gemma.json").read_text())["runs"]
    return next(r["ppl"] for r in runs if r["ctx_size"] == ctx_size)


@pytest.mark.slow
def test_perplexity_cli_llama_cpp_backend_matches_llama_perplexity(ggufswarm_cli):
    """The default (llama.cpp) backend, as two shards: within 0.1% of llama-perplexity's figure."""
    ours, ref = _cli_perplexity(ggufswarm_cli, "--threads", "2"), _llama_perplexity_figure(256)
    print(f"perplexity CLI (llama.cpp backend, split at 9) {ours:.4f}, llama-perplexity {ref:.4f}")
    assert abs(ours / ref - 1) < 0.001


@pytest.mark.slow
def test_perplexity_cli_torch_backend_near_llama_perplexity(ggufswarm_cli):
    """The torch reference (exact dequantized weights, no 8-bit activation rounding): within 1%."""
    ours, ref = _cli_perplexity(ggufswarm_cli, "--backend", "torch"), _llama_perplexity_figure(256)
    print(f"perplexity CLI (torch backend) {ours:.4f}, llama-perplexity {ref:.4f}")
    assert abs(ours / ref - 1) < 0.01
