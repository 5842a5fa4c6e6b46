"""Where a node's layers run when it has a GPU (``--gpu``): the weights ``--layers auto`` takes, the warm-up before
it says ready, and the one line that says where its blocks went (docs/gpu.md)."""

from __future__ import annotations

import sys
import time

from .state import BYTES_PER_MIB, NodeConfig, NodeState


def warm_up(executor) -> None:
    """Compile a llama.cpp shard's GPU kernels now, not in a session's first hop (``devices.warm_up``); the time it
    took goes to ``executor.warm_up_s``. Nothing for a shard without GPU blocks."""
    if not getattr(executor, "gpu_blocks", 0):
        return
    from ..runtime.llamacpp.devices import warm_up as run

    t0 = time.perf_counter()
    run(executor)
    executor.warm_up_s = time.perf_counter() - t0


DEFAULT_LAYERS_BUDGET_MB = 8192.0  # --layers auto without a GPU or --memory-budget: MiB of weights to take
GPU_WEIGHTS_SHARE = 0.75  # --layers auto with a GPU: the share of its free memory (less the fit's margin) for weights


def layers_budget(config: NodeConfig) -> int:
    """Bytes of weights ``--layers auto`` may take: ``--memory-budget``; else, on a llama.cpp node with a GPU
    (``--gpu``), GPU_WEIGHTS_SHARE of the device's free memory less ``artifact.planning.FIT_MARGIN_BYTES`` (the
    rest for the blocks' KV cache: the node then places on it what fits, the rest on the CPU), said in one line;
    else DEFAULT_LAYERS_BUDGET_MB. Raises LlamaCppError for a ``--gpu`` device that does not exist."""
    if config.memory_budget_mb is not None:
        return int(config.memory_budget_mb * BYTES_PER_MIB)
    if config.layers == "auto" and config.backend == "llama.cpp" and config.gpu != "none":
        from ..artifact.planning import FIT_MARGIN_BYTES
        from ..runtime.llamacpp.devices import choose

        device = choose(config.gpu)
        if device is not None:
            budget = max(int((device.free_bytes - FIT_MARGIN_BYTES) * GPU_WEIGHTS_SHARE), 0)
            print(
                f"ggufswarm node: --layers auto: {device.name} ({device.description}) has "
                f"{device.free_bytes / BYTES_PER_MIB:.0f} MiB free: taking up to {budget / BYTES_PER_MIB:.0f} MiB "
                "of layers (weights; the rest of it for their KV cache; --memory-budget MB sets it)",
                file=sys.stderr,
                flush=True,
            )
            return budget
    return int(DEFAULT_LAYERS_BUDGET_MB * BYTES_PER_MIB)


def say_placement(state: NodeState) -> None:
    """One line at start on where the blocks run when a GPU was asked for (``--gpu``): on it, split, or on the
    CPU and why (no GPU, none of them fits): a GPU is never given up silently."""
    placement = getattr(state.executor, "placement", None)
    if placement is None or state.config.gpu == "none":
        return
    asked = state.config.gpu_blocks
    if placement.gpu_blocks:
        line = placement.summary()
        if placement.cpu_blocks and asked is None:
            line += " (the rest did not fit in its free memory; --gpu-blocks N sets how many go there)"
        if asked is not None and asked > len(placement.gpu_blocks):
            line += f" (--gpu-blocks {asked}: the range has {len(placement.gpu_blocks)})"
        if state.spec.head and not placement.output_on_gpu:
            line += "; the output head stays on the CPU (llama.cpp could not place it on the device)"
        warm = getattr(state.executor, "warm_up_s", None)
        if warm is not None:
            line += f"; warmed up in {warm:.1f} s"
    elif state.executor.device is None:
        from ..runtime.llamacpp.devices import why_no_gpu

        line = f"--gpu {state.config.gpu}: no GPU found, all blocks run on the CPU. {why_no_gpu()}"
    elif asked == 0:
        line = f"--gpu-blocks 0: all blocks run on the CPU, none on {state.executor.device.name}"
    else:
        d = state.executor.device
        line = (
            f"{d.name} ({d.description}) has {d.free_bytes / 2**20:.0f} MiB free, not enough for one block with "
            f"its KV cache: all blocks run on the CPU (--gpu-blocks N forces N there; --ctx-size or --max-sessions "
            "smaller needs less KV)"
        )
    print(f"ggufswarm node: {line}", file=sys.stderr, flush=True)


__all__ = ["DEFAULT_LAYERS_BUDGET_MB", "GPU_WEIGHTS_SHARE", "layers_budget", "say_placement", "warm_up"]
