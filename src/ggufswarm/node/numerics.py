"""A node's numerics fingerprint (advertisement ``extra.numerics``): everything that decides the bits of its shard's
outputs, so that a client verifying a node's step commitments (node/commit.py) replays them on a node, or in a
process, of the same ``id`` and expects equal digests.

``{"id", "backend", "weights", "cpu", ...}``: ``id`` is 16 hex characters (the first 16 of the SHA-256/128 hex
digest of the canonical JSON of the rest, net/identity.py ``canonical``); ``weights`` the model's GGUF fingerprint
(SHA-256 of its headers); ``cpu`` the CPU features the compute library was built with, which select its kernels.
On llama.cpp also ``llama_cpp`` (``{"python", "ggml", "commit", "patches"}``: the llama-cpp-python version, ggml's
version and source commit, and the patches of ggufswarm's queue the loaded libllama carries), ``device`` (the GPU
the shard's blocks run on and which of them; None on the CPU), ``threads``, ``n_ubatch`` and ``batching``
(``"exact"``, or ``"throughput"``: ``--batching throughput``, where a step's bits depend on the other sessions
batched with it). On torch also ``torch`` (its version) and ``dtype`` (the compute dtype).

What changes the bits, measured here (2-core AMD EPYC with AVX-512, the bundled llama.cpp, Gemma 3 270M Q4_K_M;
shard 0:6 +embed fed a 700-token prefill of fixed random ids then 8 one-token decode steps, its outputs fed to
6:12 and to 12:18 +head under each setting; each output compared bitwise, blake2b of the float32 rows):

* threads (1 vs 2) — CHANGE: prefill rows were equal, but every decode step once the session held 256 or more
  tokens differed (a 255-token history: equal; 256, 300, 511, 512, 1024: different), as did a 1-token ubatch over
  512+ cells; llama.cpp's attention splits the KV cells among the threads. On both 6:12 and the head's logits.
* n_ubatch — CHANGES: with 128 instead of 512, rows 512-699 of the 700-token prefill differed (rows 0-511 were
  equal), and so did every later step; 256 vs 512 happened to be equal. The node always uses 512; it is in the
  fingerprint in case that changes.
* process — NO change: two runs in separate processes gave identical digests for every step.
* n_ctx per session (2048 vs 8192), n_seq_max (1 vs 4), n_batch (1024 vs 2048), kv_unified with one session — NO
  change. They are left out.
* torch backend, threads 1 vs 2 on a 300-token prefill of 6:12 — NO change (float32; left out).
* Not measured (no second CPU kind or build here): the CPU feature set and the llama.cpp build, which pick
  different kernels (AVX2 vs AVX-512 dot products round differently): included on principle.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from ..net.identity import canonical
from ..runtime.digest import digest
from .state import NodeState

ID_HEX = 16  # characters of ``id``


def _ggml_build() -> tuple[str, str]:
    """(ggml version, ggml source commit) of the loaded llama.cpp (``ggml_version`` / ``ggml_commit`` of
    libggml-base); "unknown" for what the library does not say."""
    from ..runtime.llamacpp.patches import libllama_path

    try:
        lib = ctypes.CDLL(str(Path(libllama_path()).parent / "libggml-base.so"))
        out = []
        for name in ("ggml_version", "ggml_commit"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_char_p
            out.append((fn() or b"unknown").decode())
        return out[0], out[1]
    except (OSError, AttributeError):
        return "unknown", "unknown"


def llama_cpp_cpu_features(info: str) -> list[str]:
    """The CPU features set in llama.cpp's system info (``llama_print_system_info``: ``"CPU : SSE3 = 1 | AVX = 1 |
    ..."``), in its order: the flags the loaded ggml CPU backend was built with and selects kernels by."""
    section, features = "", []
    for part in info.split("|"):
        part = part.strip()
        if " : " in part:
            section, part = (p.strip() for p in part.split(" : ", 1))
        name, _, value = part.partition("=")
        if section == "CPU" and value.strip() == "1":
            features.append(name.strip())
    return features


def _llama_cpp(state: NodeState) -> dict:
    import llama_cpp as L

    from ..runtime.llamacpp.patches import PATCH_MARKERS, applied

    version, commit = _ggml_build()
    executor = state.executor
    return {
        "llama_cpp": {
            "python": L.__version__,
            "ggml": version,
            "commit": commit,
            "patches": [name for name in PATCH_MARKERS if applied(name)],
        },
        "cpu": llama_cpp_cpu_features(L.llama_print_system_info().decode(errors="replace")),
        # the device the blocks run on: another device, backend or split computes other bits
        "device": _device(executor),
        "threads": getattr(executor, "threads", None),
        "n_ubatch": getattr(executor, "n_ubatch", None),
        "batching": state.config.batching,
    }


def _device(executor) -> dict | None:
    """None on the CPU, else ``{"backend", "name", "description", "gpu_blocks"}`` of the GPU the shard's blocks
    run on (the device's description names its driver where ggml's backend does: ``llvmpipe (LLVM 15.0.6, 256
    bits)``)."""
    p = getattr(executor, "placement", None)
    if p is None or not p.gpu_blocks:
        return None
    return {"backend": p.backend, "name": p.device, "description": p.description, "gpu_blocks": p.gpu_blocks}


def _torch(state: NodeState) -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "dtype": str(getattr(state.executor, "dtype", state.config.dtype)).removeprefix("torch."),
        "cpu": [torch.backends.cpu.get_cpu_capability()],
    }


def numerics(state: NodeState) -> dict:
    """This node's numerics fingerprint (module docstring), computed once and kept on ``state.numerics``."""
    if state.numerics is None:
        backend = getattr(state.executor, "backend", "unknown")
        model = getattr(state.executor, "model", None)
        rest = {"backend": backend, "weights": getattr(model, "fingerprint", None)}
        if backend == "llama.cpp":
            rest |= _llama_cpp(state)
        elif backend == "torch":
            rest |= _torch(state)
        state.numerics = {"id": digest(canonical(rest))[:ID_HEX], **rest}
    return state.numerics


__all__ = ["llama_cpp_cpu_features", "numerics"]
