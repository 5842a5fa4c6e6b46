"""How much KV cache a node offers and how long one session may be (docs/memory.md).

A llama.cpp node's KV cache is one context of ``--max-sessions`` + 1 streams (the spare one is exact batching's) of
``n_ctx_seq`` cells each. With llama.cpp patch 0007 and the cache in host memory (no GPU blocks), those streams are
address space only: a page becomes resident when a session writes a cell in it, and goes back to the OS when the
cells are freed (a session closed, truncated or moved). Such a node is **paged**: each stream may be as long as the
model's context (a session may take the whole budget), and the budget, not the streams, bounds what its sessions
reserve together (``SessionStore``: each session reserves its ``max_length`` at open; one that does not fit is
refused with ``kv_budget_full`` and the numbers). With the cache on a GPU (VRAM: no pages to give back) the context
is sized to the open sessions instead, grown and shrunk by copy (``runtime/llamacpp/kv_size.py``; **grows**): a session
may be as long too. Otherwise (no patch, or throughput mode on a GPU) the streams are allocated as sized: ``--ctx-size``
defaults to DEFAULT_CTX_SIZE and one session to 1/``--max-sessions`` of the budget.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import glob
import os
import sys

from ..runtime.llamacpp import NO_VULKAN_DRIVER
from ..runtime.session_state import UnknownSession
from .state import BYTES_PER_MIB, DEFAULT_CTX_SIZE, NodeConfig

KV_MEMORY_SHARE = 0.5  # a paged node's default KV budget: this share of the memory available at its start
ADDRESS_SPACE_SHARE = 0.5  # a paged node's streams together: at most this share of the machine's RAM (overcommit)
PAGED_PATCH = "0007-kv-give-back-unused-cells"
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt parameters (glibc's malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed (tune_malloc)
MMAP_SLACK = 64 * 1024  # above the largest per-step output (tune_malloc)
MALLOC_ARENAS = 2  # heaps the node's threads share: the event loop's and the workers' (tune_malloc)
# device files through which a GPU's driver is reached on Linux: DRM render nodes (Mesa's AMD, Intel, ... drivers),
# NVIDIA's, AMD ROCm's, WSL's GPU
GPU_DEVICE_FILES = ("/dev/dri/renderD*", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def no_gpu_to_look_for(gpu: str) -> bool:
    """Whether a llama.cpp node given ``--gpu gpu`` can skip loading the machine's Vulkan drivers: ``none``, or
    ``auto`` on a Linux machine with none of GPU_DEVICE_FILES (no GPU a driver could reach; Mesa's software
    lavapipe is then all it would find, which ``auto`` never picks) and no ``GGML_VK_VISIBLE_DEVICES`` (the user
    listing Vulkan devices, lavapipe included)."""
    if gpu == "none":
        return True
    if gpu != "auto" or not sys.platform.startswith("linux") or "GGML_VK_VISIBLE_DEVICES" in os.environ:
        return False
    return not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def skip_gpu_drivers() -> None:
    """``--gpu none`` (or ``auto`` with no GPU: ``no_gpu_to_look_for``): point the Vulkan loader at no driver
    (``VK_DRIVER_FILES``, and ``VK_ICD_FILENAMES`` for older loaders; a value the user set is kept) before llama.cpp
    starts, so that ggml's Vulkan backend finds no device without loading any (what Mesa's drivers would cost:
    docs/memory.md, "The parts").
    For the node's own process (its environment is its children's too), before llama.cpp is loaded."""
    for var in ("VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        os.environ.setdefault(var, NO_VULKAN_DRIVER)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc (its ``mallopt`` and ``malloc_trim``); None where the C library cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _call_libc(name: str, *args: int) -> None:
    """``libc.name(*args)`` where the C library has it (glibc); nothing elsewhere."""
    fn = getattr(_libc(), name, None)
    if fn is not None:
        fn(*args)


def tune_malloc(per_step_bytes: int = 0) -> None:
    """Keep a node's C heap near what it holds (glibc's ``mallopt``; nothing elsewhere): allocations above a fixed
    size are their own mappings, given back when freed, and threads share at most MALLOC_ARENAS heaps. glibc's
    default raises that size up to 32 MiB as such blocks are freed, after which a model load's and a long prefill's
    megabyte temporaries stay on the heap as free, fragmented pages. Called at the node's start (the size:
    MMAP_THRESHOLD_BYTES), then once its shard is loaded with ``per_step_bytes``, the largest output a step copies
    out of llama.cpp every time (a head's logits rows: a verify step's, 16 x 1 MiB for 262144 tokens), which stays
    below the size and so reuses heap memory instead of mapping and faulting in fresh pages each step (~0.5 ms a
    MiB here). docs/memory.md, "The parts"."""
    threshold = max(MMAP_THRESHOLD_BYTES, per_step_bytes + MMAP_SLACK if per_step_bytes else 0)
    _call_libc("mallopt", M_MMAP_THRESHOLD, threshold)
    _call_libc("mallopt", M_ARENA_MAX, MALLOC_ARENAS)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere): after a node's
    last session closed, the frames of a long prefill (megabytes each) may otherwise stay resident as free heap."""
    _call_libc("malloc_trim", 0)


def trim_idle(executor) -> None:
    """A node with no session left gives back what its last sessions made resident: llama.cpp's compute buffers
    (a llama.cpp shard's ``trim_compute_buffers``, patch 0012) and the C heap's free pages (``trim_heap``)."""
    trim = getattr(executor, "trim_compute_buffers", None)
    if trim is not None:
        trim()
    trim_heap()


async def trim_if_idle(store, executor) -> None:
    """After sessions of ``store`` (a SessionStore) closed, expired or were evicted: when none is left, ``trim_idle``
    off the event loop (it waits for a step in flight on the shard's lock); else a KV cache sized to its sessions
    (a llama.cpp shard's ``kv_grows``) is fitted to those left (``fit_kv``)."""
    if not store.sessions:
        await asyncio.to_thread(trim_idle, executor)
    elif getattr(executor, "kv_grows", False):  # a GPU's KV cache: shrunk to the sessions left where it halves
        await asyncio.to_thread(executor.fit_kv)


def meminfo(field: str) -> int | None:
    """``/proc/meminfo``'s ``field`` (MemAvailable, MemTotal) in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kv_paged(config: NodeConfig) -> bool:
    """Whether this node's KV memory is resident only as its sessions use it: the llama.cpp backend with patch 0007
    (PAGED_PATCH) and its cache in host memory (``--gpu none``, or no GPU found), on Linux."""
    if config.backend != "llama.cpp" or meminfo("MemTotal") is None:
        return False
    from ..runtime.llamacpp import patches

    if not patches.applied(PAGED_PATCH):
        return False
    if config.gpu == "none":
        return True
    from ..runtime.llamacpp.devices import choose

    return choose(config.gpu) is None  # LlamaCppError for a device that does not exist: as the load would


def kv_grows(config: NodeConfig) -> bool:
    """Whether this node's KV cache is a GPU's, sized to its open sessions and copied when they need more or less
    (``LlamaCppShard.kv_grows``, runtime/llamacpp/kv_size.py): the llama.cpp backend in exact batching mode with a
    GPU found for ``--gpu`` and blocks to put there."""
    if config.backend != "llama.cpp" or config.batching == "throughput" or config.gpu == "none":
        return False
    if config.gpu_blocks == 0:
        return False
    from ..runtime.llamacpp.devices import choose

    return choose(config.gpu) is not None  # LlamaCppError for a device that does not exist: as the load would


def with_kv_defaults(config: NodeConfig) -> NodeConfig:
    """``config`` with a paged node's default KV budget: ``--kv-budget-mb`` unset becomes KV_MEMORY_SHARE of the
    memory available now (``/proc/meminfo`` MemAvailable). Other nodes' configs are returned as they are."""
    from dataclasses import replace

    if config.kv_budget_mb is not None or not kv_paged(config):
        return config
    available = meminfo("MemAvailable") or 0
    return replace(config, kv_budget_mb=max(available * KV_MEMORY_SHARE / BYTES_PER_MIB, 1.0))


def watch_memory(config: NodeConfig, store, executor) -> None:
    """On a paged node (kv_paged), make ``store`` (a runtime.sessions.SessionStore) check each session against the
    memory the machine has available when it opens (``/proc/meminfo`` MemAvailable), with llama.cpp's compute and
    output buffers (``executor.placement``, bytes) as the margin they may still take: a session that would not fit
    is refused (``kv_budget_full``), never admitted and killed for memory later. On a node whose KV cache is a GPU's
    (``kv_grows``), the memory is what its device holds now (``watch_device``). Other nodes: nothing."""
    if getattr(executor, "kv_grows", False):
        watch_device(store, executor)
        return
    if not kv_paged(config):
        return
    buffers = getattr(getattr(executor, "placement", None), "buffers", None) or {}
    store.memory_margin_bytes = sum(b.get("compute", 0) + b.get("output", 0) for b in buffers.values())
    store.memory_available = lambda: meminfo("MemAvailable")


def watch_device(store, executor) -> None:
    """Make ``store`` count a GPU node's sessions against the KV its device holds now, as its free memory changes
    (other processes take and give back VRAM): ``executor.device_kv_tokens()`` (kv_size.device_tokens: free memory
    less the fit margin, plus the KV cache the context holds, in tokens) as the memory available, less the tokens the
    sessions hold already (the store counts what they may still write): a session beyond it is refused at open
    (``kv_budget_full``), and the advertisement offers no more. Nothing is evicted for it: an admitted session's
    cells are in the context already (``evict_for_memory``)."""
    per_token = max(store.kv_bytes_per_token(), 1)

    def device_bytes() -> int | None:
        tokens = executor.device_kv_tokens()
        return None if tokens is None else max(tokens - store.held_tokens, 0) * per_token

    store.memory_available, store.memory_margin_bytes = device_bytes, 0


def evict_for_memory(store) -> list[str]:
    """Where ``store`` watches memory (``watch_memory``) and the machine's available memory no longer holds what the
    node has committed (the KV its open sessions may still write up to their ``max_length``, and its buffers'
    margin): other processes took memory after the sessions were admitted. Evicts idle sessions, the one with the
    most KV still to write first, until it does: each is closed, its KV freed, and its next step is refused with
    ``unknown_session`` saying why (a client repairs its route: docs/protocol.md, "Route repair"). Returns a line per
    eviction, for the node's log; none where memory is not watched or suffices."""
    if getattr(store.executor, "kv_grows", False) or (memory := store.memory()) is None:
        return []  # (a GPU's sessions hold their cells: watch_device only refuses new ones)
    available, committed = memory
    per_token = max(store.kv_bytes_per_token(), 1)
    idle = [s for s in list(store.sessions.values()) if not s.busy and not s.stepping]
    lines = []
    for session in sorted(idle, key=lambda s: s.kv.length - s.max_length):
        if committed <= available:
            break
        held, pending = session.kv.length, max(session.max_length - session.kv.length, 0) * per_token
        reason = (
            f"the machine's memory no longer holds it: {available >> 20} MiB available, while this node's sessions "
            f"and buffers may still take {committed >> 20} MiB"
        )
        try:
            store.evict(session.id, reason)
        except UnknownSession:  # closed meanwhile
            continue
        committed, available = committed - pending, available + held * per_token  # its KV is freed too
        lines.append(f"evicted session {session.id} ({held} of {session.max_length} tokens held): {reason}")
    return lines


def session_cells(config: NodeConfig, max_length: int, kv_bytes_per_token: int) -> int:
    """KV cells of each of a llama.cpp node's streams: the longest session it takes (tokens).

    ``max_length``: the model's context; ``kv_bytes_per_token``: the shard's (all its layers, keys and values).
    Paged (kv_paged): ``--ctx-size`` or the model's context, within the budget (``--kv-budget``,
    ``--kv-budget-mb``) and such that all ``--max-sessions`` + 1 streams take at most ADDRESS_SPACE_SHARE of the
    RAM in address space. Grows (kv_grows): ``--ctx-size`` or the model's context, within the budget. Otherwise
    ``--ctx-size`` or DEFAULT_CTX_SIZE, within the model's context and 1/``--max-sessions`` of the budget (the cells
    are allocated: one session may not take them all)."""
    per_token = max(kv_bytes_per_token, 1)
    budget = config.kv_budget_tokens
    if config.kv_budget_mb is not None:
        budget = min(budget, int(config.kv_budget_mb * BYTES_PER_MIB) // per_token)
    if kv_paged(config):
        streams = config.max_sessions + 1
        space = int((meminfo("MemTotal") or 0) * ADDRESS_SPACE_SHARE) // (streams * per_token)
        cells = min(config.ctx_size or max_length, max_length, budget, space)
    elif kv_grows(config):
        cells = min(config.ctx_size or max_length, max_length, budget)
    else:
        cells = min(config.ctx_size or DEFAULT_CTX_SIZE, max_length, budget // config.max_sessions)
    return max(cells, 1)


__all__ = [
    "evict_for_memory",
    "kv_grows",
    "kv_paged",
    "meminfo",
    "no_gpu_to_look_for",
    "session_cells",
    "skip_gpu_drivers",
    "trim_heap",
    "trim_idle",
    "trim_if_idle",
    "tune_malloc",
    "watch_device",
    "watch_memory",
    "with_kv_defaults",
]
