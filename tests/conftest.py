"""Shared fixtures: the embedded Gemma model, llama.cpp references, tiny random GGUFs."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The embedded default model (assembled once, SHA-256 checked)."""
    from ggufswarm.artifact.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma(gemma_path):
    """Gemma 3 270M as one in-process shard on the default backend (llama.cpp): the reference of route tests.

    One thread, as the test nodes: llama.cpp's split-KV attention (a cache of 512+ cells) divides the
    cells among the threads, so the thread count is part of its numerics."""
    from ggufswarm.client.local import LocalModel

    return LocalModel.load(gemma_path, max_length=4096, threads=1)


@pytest.fixture(scope="session")
def gemma_torch(gemma_path):
    """Gemma 3 270M as one in-process float32 shard on the torch (reference) backend."""
    from ggufswarm.client.local import LocalModel

    return LocalModel.load(gemma_path, backend="torch")


def llama_cpp_model(path, n_ctx: int = 2048, logits_all: bool = True):
    """llama.cpp (llama-cpp-python) on ``path``: 2 threads, f32 KV cache so the reference is not
    rounded to f16 before the comparison."""
    import llama_cpp

    return llama_cpp.Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        logits_all=logits_all,
        n_threads=2,
        type_k=0,
        type_v=0,
        verbose=False,
    )  # n_batch 512: 512 rows of logits at once


@pytest.fixture(scope="module")
def gemma_f32_path(gemma_path, tmp_path_factory) -> Path:
    """The Gemma file dequantized to F32 *by llama.cpp* (``llama_model_quantize`` to ALL_F32).

    llama.cpp's quantized kernels round activations to 8 bits before each dot product; running
    llama.cpp on its own dequantization of the same weights shows what the GGUF means without that
    rounding. ~1 GB, written to a temporary directory, deleted after the run.
    """
    import llama_cpp

    out = tmp_path_factory.mktemp("f32") / "gemma-f32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 0  # LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(gemma_path).encode(), str(out).encode(), params)
    assert rc == 0, "llama_model_quantize failed"
    yield out
    out.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def gemma_f32_llama_cpp(gemma_f32_path):
    """llama.cpp on its own F32 dequantization of the Gemma file."""
    return llama_cpp_model(gemma_f32_path)


@pytest.fixture(scope="session")
def reference_text() -> str:
    """A real English text (the GPL-3.0 preamble and first sections, ~1700 Gemma tokens)."""
    return (DATA / "gpl-3.0-excerpt.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def zoo_dir() -> Path:
    """llama.cpp's architecture zoo (tests/zoo.py), written once per machine: ``$GGUFSWARM_TEST_ZOO_DIR``, else by the
    test-llama-archs of the kept wheel build tree into ``~/.cache/ggufswarm/zoo/<key>/``."""
    import zoo

    written = os.environ.get("GGUFSWARM_TEST_ZOO_DIR")
    if written:
        return Path(written)
    tool, why = zoo.find_tool()
    if tool is None:  # make setup keeps the build tree it comes from: its absence is a failure, not a skip
        pytest.fail(f"no test-llama-archs to write the zoo with: {why}")
    return zoo.write_zoo(tool)


@pytest.fixture(scope="session")
def ggufswarm_cli():
    """Command prefix that runs the ggufswarm CLI of this checkout."""
    return [sys.executable, "-m", "ggufswarm.cli"]


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage_between_modules():
    """llama.cpp contexts and models (hundreds of MB each) are freed with their Python owners; run the cycle
    collector after every module so owners caught in reference cycles do not pile up across modules."""
    yield
    gc.collect()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
