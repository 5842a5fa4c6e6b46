"""A node's numerics fingerprint (advertisement ``extra.numerics``): everything that decides the bits of its shard's
outputs, so that a client verifying a node's step commitments (node/commit.py) replays them on a node, or in a
process, of the same ``id`` and expects equal digests. The fields, and which settings were measured to change the
bits: docs/protocol.md, "Numerics fingerprint"."""

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
    from ..runtime.llamacpp import bindings
    from ..runtime.llamacpp.patches import PATCH_MARKERS, applied

    version, commit = _ggml_build()
    executor = state.executor
    return {
        "llama_cpp": {
            "python": bindings.version(),
            "ggml": version,
            "commit": commit,
            "patches": [name for name in PATCH_MARKERS if applied(name)],
        },
        "cpu": llama_cpp_cpu_features(bindings.L.llama_print_system_info().decode(errors="replace")),
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
    """This node's numerics fingerprint (docs/protocol.md, "Numerics fingerprint"), computed once and kept on
    ``state.numerics``."""
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
