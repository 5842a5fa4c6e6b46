"""Which patches of ggufswarm's llama.cpp patch queue the loaded libllama carries.

``make setup`` builds llama-cpp-python from its source distribution with the patches of ``patches/llama.cpp``
applied to its ``vendor/llama.cpp`` (``scripts/build_llama_cpp_python.sh``). A user's own llama-cpp-python has
none of them: the architectures that need one then run only as whole models, and a node asked for a layer range
of them says so in one line. Each patch leaves a string in libllama that this module looks for (the GGUF key or
message the patch adds; a patch of ggml's, in libggml-base beside it), so the check reads the library files once
and loads nothing.
"""

from __future__ import annotations

import functools
from pathlib import Path

# patch (file name without .patch) -> a string that patch adds to libllama's read-only data
PATCH_MARKERS: dict[str, bytes] = {
    "0001-embedding-length-in": b"%s.embedding_length_in",
    "0002-deepseek4-layer-range": b"DeepSeek-V4 embedding_length_in must be",
    "0003-hidden-state-input": b"a layer range sets embedding_length_in",
    "0004-split-sources": b"split.sources.block_offset",
    "0005-batch-invariant-decode": b"LLAMA_BATCH_INVARIANT",
    "0007-kv-give-back-unused-cells": b"gave back the memory of cells",
    "0008-kv-cell-metadata-on-demand": b"resident as cells are used",
    "0009-unmap-unused-gaps": b"unmapped the gaps between",
    "0010-cpu-buffer-clear-gives-pages-back": b"by giving its pages back to the OS as zeros",  # in libggml-base
    "0011-one-kind-layer-ranges": b"no sliding-window layer: the sliding-window KV cache holds no layers",
    "0012-compute-buffers-given-back-when-idle": b"gave the compute and output buffers' memory back",
    "0013-layer-ranges-compute-as-whole": b"%s.block_count_whole",
    "0014-hybrid-ranges-start-at-any-block": b"head sizes from the first block with heads",
    "0015-hyper-connection-ranges": b"hy_v4: embedding_length_in must be",
    "0016-seq-state-across-stream-counts": b"n_stream mismatch: a whole cache's state restores into as many streams",
    "0017-indexer-free-ranges": b"no attention layer: the graph leaves the k-pool indexer inputs unset",
    "0018-talkie-output-optional": b"talkie without an output head: the graph ends at the hidden states",
    "0019-attention-residual-ranges": b"kimi-k3: embedding_length_in must be (checkpoints + 1) * embedding_length",
    "0020-block-patterns-of-the-whole-model": b"block patterns counted from the whole model's block 0",
}
# patches that only let llama.cpp compile somewhere (nothing in a library to look for, nothing for the runtime to
# check): the Vulkan backend with older Vulkan headers
BUILD_ONLY: frozenset[str] = frozenset({"0006-vulkan-older-headers"})
# a patch needs the ones it builds on
REQUIRES: dict[str, tuple[str, ...]] = {
    "0002-deepseek4-layer-range": ("0001-embedding-length-in",),
    "0003-hidden-state-input": ("0001-embedding-length-in",),
    "0013-layer-ranges-compute-as-whole": ("0001-embedding-length-in",),
    "0015-hyper-connection-ranges": ("0001-embedding-length-in",),
    # (an empty DSA cache: 0002's kv-cache change; the hybrid and sliding-window inputs of a one-kind graph: 0011)
    "0017-indexer-free-ranges": ("0002-deepseek4-layer-range", "0011-one-kind-layer-ranges"),
    "0018-talkie-output-optional": ("0013-layer-ranges-compute-as-whole",),
    # (block_offset, which blocks of the range bank a checkpoint)
    "0019-attention-residual-ranges": ("0013-layer-ranges-compute-as-whole",),
    "0020-block-patterns-of-the-whole-model": ("0013-layer-ranges-compute-as-whole",),
}


def libllama_path() -> Path:
    """The libllama shared library llama-cpp-python loaded (``llama_cpp.llama_cpp._lib``)."""
    from .bindings import L

    return Path(L._lib._name)


@functools.cache
def _library_bytes(path: str) -> bytes:
    """The bytes of libllama at ``path`` and of the libggml-base beside it, where there is one."""
    lib = Path(path)
    ggml_base = min(lib.parent.glob("libggml-base.*"), default=None)
    return lib.read_bytes() + (ggml_base.read_bytes() if ggml_base is not None else b"")


@functools.cache
def _carries(path: str, markers: tuple[bytes, ...]) -> bool:
    data = _library_bytes(path)  # (a search of megabytes: the node's range check asks once per candidate range)
    return all(marker in data for marker in markers)


def applied(name: str) -> bool:
    """Whether the loaded libllama carries patch ``name`` (and the patches it builds on). KeyError: unknown."""
    return _carries(str(libllama_path()), tuple(PATCH_MARKERS[n] for n in (*REQUIRES.get(name, ()), name)))


def patch_problem(name: str, what: str) -> str | None:
    """Why ``what`` cannot run on the loaded libllama (one line: which patch it needs, and how to get it), or None
    where ``applied(name)``."""
    if applied(name):
        return None
    return (
        f"{what} needs llama.cpp patch {name} (patches/llama.cpp in ggufswarm), which the llama-cpp-python at "
        f"{libllama_path().parent.parent} does not carry; `make setup` builds one with the patch queue "
        f"(until then only the whole model runs)"
    )


def require_patch(name: str, what: str) -> None:
    """Raise UnsupportedShard (``patch_problem``'s line) unless ``applied(name)``."""
    problem = patch_problem(name, what)
    if problem:
        from .errors import UnsupportedShard

        raise UnsupportedShard(problem)


__all__ = ["BUILD_ONLY", "PATCH_MARKERS", "applied", "libllama_path", "patch_problem", "require_patch"]
