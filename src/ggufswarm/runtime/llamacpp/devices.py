"""The compute devices llama.cpp sees (ggml's backend device registry, ``ggml-backend.h``) and the one a node's
layers run on: ``ggufswarm node --gpu auto|none|DEVICE``.

A device is what ggml registers: ``CPU`` always; ``CUDA0``, ``Vulkan0``, ``ROCm0``, ``Metal`` when the wheel was
built with that backend (scripts/build_llama_cpp_python.sh) and the machine has one. ggml-vulkan lists only
discrete and integrated GPUs unless ``GGML_VK_VISIBLE_DEVICES`` names a device (Mesa's lavapipe, a software Vulkan
device on the CPU, is listed only then: tests/test_gpu.py)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...artifact.accounting import HeaderAccounts
from ...artifact.planning import device_blocks
from ..spec import ShardSpec
from . import NO_VULKAN_DRIVER, ffi
from .bindings import L
from .errors import LlamaCppError
from .ffi import ensure_backend
from .patches import libllama_path

# enum ggml_backend_dev_type (ggml-backend.h)
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
# "<func>: <buffer type> <what> buffer size = <MiB> MiB" (src/llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp,
# llama-memory-recurrent.cpp: llama.cpp's own report of each buffer it allocates)
BUFFER_LINE = re.compile(r"^\w+:\s+(\S+)\s+(model|KV|compute|output|RS|DSV4 \w+ state) buffer size =\s+([\d.]+) MiB")
MIB = 1 << 20
WARM_UP_TOKENS = 64  # positions of the throw-away prefill warm_up runs (then one decode step)


@dataclass(frozen=True)
class Device:
    """One ggml backend device. ``name``: ggml's (``Vulkan0``, ``CUDA0``); ``backend``: its registry's
    (``Vulkan``, ``CUDA``); ``kind``: cpu | gpu | igpu | accel | meta; ``free_bytes``/``total_bytes``: its memory
    as the backend reports it when asked (bytes); ``handle``: the ``ggml_backend_dev_t``."""

    name: str
    description: str
    backend: str
    kind: str
    free_bytes: int
    total_bytes: int
    handle: int

    def to_json(self) -> dict:
        """``{"name", "description", "backend", "kind", "free_bytes", "total_bytes"}``."""
        return {
            "name": self.name,
            "description": self.description,
            "backend": self.backend,
            "kind": self.kind,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
        }


@functools.cache
def _ggml() -> ctypes.CDLL:
    """libggml (the backend registry) of the llama.cpp llama-cpp-python loaded."""
    lib = ctypes.CDLL(str(Path(libllama_path()).parent / "libggml.so"))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in (
        ("ggml_backend_dev_count", sz, []),
        ("ggml_backend_dev_get", vp, [sz]),
        ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_description", ctypes.c_char_p, [vp]),
        ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]),
        ("ggml_backend_dev_backend_reg", vp, [vp]),
        ("ggml_backend_reg_name", ctypes.c_char_p, [vp]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _device(lib: ctypes.CDLL, handle: int) -> Device:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.ggml_backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    reg = lib.ggml_backend_dev_backend_reg(handle)
    return Device(
        name=(lib.ggml_backend_dev_name(handle) or b"").decode(errors="replace"),
        description=(lib.ggml_backend_dev_description(handle) or b"").decode(errors="replace"),
        backend=(lib.ggml_backend_reg_name(reg) or b"").decode(errors="replace") if reg else "",
        kind=DEVICE_TYPES.get(lib.ggml_backend_dev_type(handle), "unknown"),
        free_bytes=free.value,
        total_bytes=total.value,
        handle=handle,
    )


def devices() -> list[Device]:
    """Every device ggml registered, CPU included, with its memory now (free bytes change as processes use it)."""
    ensure_backend()
    lib = _ggml()
    return [_device(lib, lib.ggml_backend_dev_get(i)) for i in range(lib.ggml_backend_dev_count())]


def gpus() -> list[Device]:
    """The devices a node's layers can be offloaded to (discrete or integrated GPUs)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu")]


def choose(gpu: str) -> Device | None:
    """The device ``--gpu`` names: ``none`` → None (CPU); ``auto`` → the first GPU, or None when there is none
    (the CPU: a machine without a GPU is not an error); a device name (``Vulkan0``, ``CUDA1``; case-insensitive) →
    that device. Raises LlamaCppError for a name no device has, saying which there are, or that this build has
    no backend of that kind and how to get one."""
    want = gpu.strip()
    if want.lower() == "none":
        return None
    found = gpus()
    if want.lower() == "auto":
        return found[0] if found else None
    for d in found:
        if d.name.lower() == want.lower():
            return d
    kind = re.sub(r"\d+$", "", want)
    regs = _gpu_registries()
    if kind and kind.lower() not in {r.lower() for r in regs} | {d.name.rstrip("0123456789").lower() for d in found}:
        have = f"only {', '.join(sorted(regs))}" if regs else "no GPU backend"
        raise LlamaCppError(
            f"--gpu {want}: this llama.cpp build has {have}, no {kind} backend; make setup builds the one the "
            f"machine has (GGUFSWARM_GPU=cuda|vulkan|hip|metal chooses)"
        )
    listed = ", ".join(f"{d.name} ({d.description})" for d in found)
    raise LlamaCppError(f"--gpu {want}: no such GPU; this llama.cpp sees {listed or 'none'}. {why_no_gpu()}")


def why_no_gpu() -> str:
    """One sentence on what this build can offload to: the GPU backends the loaded llama.cpp has, or none."""
    regs = sorted(_gpu_registries())
    if os.environ.get("VK_DRIVER_FILES") == NO_VULKAN_DRIVER:  # (node.memory.skip_gpu_drivers)
        return (
            "This machine has no GPU device file (/dev/dri/renderD*, /dev/nvidia*, /dev/kfd, /dev/dxg): no GPU "
            "driver was loaded."
        )
    if not regs:
        return (
            "The installed llama.cpp was built without a GPU backend: make setup builds CUDA, Vulkan, HIP or Metal "
            "when their toolkit is installed (GGUFSWARM_GPU=cuda|vulkan|hip|metal chooses)."
        )
    if gpus():
        return f"Its GPU backends: {', '.join(regs)}."
    return (
        f"Its GPU backends ({', '.join(regs)}) see no GPU: is its driver installed? (A software Vulkan device, "
        "lavapipe, is listed only when GGML_VK_VISIBLE_DEVICES names it.)"
    )


def _gpu_registries() -> set[str]:
    lib = ctypes.CDLL(str(Path(libllama_path()).parent / "libggml.so"))
    count, get = lib.ggml_backend_reg_count, lib.ggml_backend_reg_get
    count.restype, get.restype, get.argtypes = ctypes.c_size_t, ctypes.c_void_p, [ctypes.c_size_t]
    names = {(_ggml().ggml_backend_reg_name(get(i)) or b"").decode() for i in range(count())}
    return names - {"CPU", "BLAS", "RPC", ""}


def gpu_fit(model, spec: ShardSpec, free_bytes: int, tokens: int, sessions: int, n_ubatch: int) -> int:
    """How many of ``spec``'s last blocks fit in ``free_bytes`` of device memory with ``sessions`` sessions of
    ``tokens`` KV cells each: ``artifact.planning.device_blocks`` on the model's header, the formula
    ``plan --node-memory SIZE,gpu=SIZE`` uses."""
    acc = HeaderAccounts.from_model(model)
    return device_blocks(acc, spec.start, spec.end, spec.head, free_bytes, tokens, sessions, n_ubatch)


def _holds_output(on_device: dict, gpu_blocks: int, spec: ShardSpec, model) -> bool:
    if model is None:
        return True
    acc = HeaderAccounts.from_model(model)
    blocks = sum(layer.weight_bytes for layer in acc.layers[spec.end - gpu_blocks : spec.end])
    return on_device.get("model", 0) >= blocks + acc.head_bytes // 2


def offload(model, spec: ShardSpec, gpu: str, gpu_blocks: int | None, tokens: int, sessions: int, n_ubatch: int):
    """``(device, blocks)``: the device ``--gpu`` names (``choose``; None: the CPU) and how many of ``spec``'s last
    blocks go there: ``gpu_blocks`` (clamped to the range), or as many as fit (``gpu_fit``) with ``sessions``
    sessions of ``tokens`` KV cells each."""
    device = choose(gpu)
    if device is None:
        return None, 0
    if gpu_blocks is None:
        return device, gpu_fit(model, spec, device.free_bytes, tokens, sessions, n_ubatch)
    return device, max(0, min(int(gpu_blocks), spec.end - spec.start))


def set_offload(mparams, device: Device | None, blocks: int):
    """Set ``llama_model_params`` ``mparams`` to put the last ``blocks`` blocks (and the output past them) on
    ``device``, and nothing on any other device (an empty device list: not even a large prompt's matmuls go to a
    GPU, op_offload). ``n_gpu_layers`` counts the output layer as one past the last block and offloads the last N
    of them all (src/llama-model.cpp, load_tensors). Returns the device array, which must outlive the load."""
    array = (ctypes.c_void_p * 2)(device.handle if device is not None and blocks else None, None)
    mparams.devices = ctypes.addressof(array)
    mparams.split_mode = L.LLAMA_SPLIT_MODE_NONE
    mparams.main_gpu = 0
    mparams.n_gpu_layers = blocks + 1 if blocks else 0
    return array


def load_model(paths: list, mparams):
    """``(llama_model *, buffer report)``: llama.cpp's load of a shard's files ``paths`` (one file, or a split set:
    ``llama_model_load_from_splits``) with ``mparams``, and the buffers it reported (``buffer_report``); the
    pointer is NULL when llama.cpp refused (its error is in its log)."""
    with buffer_report() as report:
        if len(paths) == 1:
            model = L.llama_model_load_from_file(str(paths[0]).encode(), mparams)
        else:
            names = (ctypes.c_char_p * len(paths))(*[str(p).encode() for p in paths])
            model = L.llama_model_load_from_splits(names, len(paths), mparams)
    return model, report


def warm_up(shard, tokens: int = WARM_UP_TOKENS) -> None:
    """Run a throw-away session of llama.cpp shard ``shard``: a prefill of ``tokens`` positions and one decode step,
    then free it. A GPU backend compiles or loads its kernels for those shapes now (Vulkan's shaders: a minute on a
    software device the first time), not in a session's first steps, where a hop timeout would end it; as
    llama.cpp's own tools warm up (common/common.cpp). Changes no other session."""
    n = max(1, min(int(tokens), shard.n_batch, shard.n_ctx_seq - 1))
    kv = shard.new_session(n + 1)
    try:
        for rows in (n, 1):
            if shard.takes_tokens or shard.embedding is not None:
                x = np.zeros(rows, dtype=np.int64)
            else:
                x = np.zeros((rows, shard.n_embd_in), dtype=np.float32)
            ids = {"token_ids": np.zeros(rows, dtype=np.int32)} if shard.needs_token_ids else {}
            shard.forward(kv, x, logits="last", **ids)
    finally:
        kv.close()


def placement_now(shard) -> dict:
    """``shard.placement`` as JSON, with the GPU's ``free_bytes``/``total_bytes`` as its backend reports them now."""
    out = shard.placement.to_json()
    if shard.placement.gpu_blocks and shard.device is not None:
        now = next((d for d in devices() if d.handle == shard.device.handle), None)
        if now is not None:
            out["free_bytes"], out["total_bytes"] = now.free_bytes, now.total_bytes
    return out


_REPORT_LOCK = threading.Lock()


@contextlib.contextmanager
def buffer_report() -> Iterator[list[tuple[str, str, int]]]:
    """Collect llama.cpp's buffer report while a model or context is created in the block: a list, filled on
    exit, of ``(buffer type, what, bytes)`` (``("Vulkan0", "model", 95551488)``; ``what``: model, KV, compute,
    output, RS). Its log prints the sizes in MiB with two decimals: each is exact to ±0.005 MiB."""
    found: list[tuple[str, str, int]] = []
    with _REPORT_LOCK, ffi.capture_log() as lines:
        yield found
    for line in "".join(lines).splitlines():
        m = BUFFER_LINE.match(line.strip())
        if m:
            found.append((m.group(1), m.group(2), round(float(m.group(3)) * MIB)))


@dataclass
class Placement:
    """Where a llama.cpp shard's layers run and what llama.cpp allocated for it (``/health``, the
    advertisement's ``extra.placement``). ``device``: ggml's name of the GPU (``Vulkan0``) or ``CPU``;
    ``gpu_blocks``/``cpu_blocks``: absolute block indices on each; ``output_on_gpu``: the head's output norm and
    LM head; ``buffers``: llama.cpp's buffers ``{buffer type: {what: bytes}}`` (``{"Vulkan0": {"model": ...,
    "KV": ..., "compute": ...}, "CPU_Mapped": {"model": ...}}``); ``device_bytes``: those on the GPU;
    ``total_bytes``/``free_bytes``: the GPU's memory when the shard was loaded."""

    device: str
    description: str = ""
    backend: str = "CPU"
    gpu_blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    output_on_gpu: bool = False
    buffers: dict[str, dict[str, int]] = field(default_factory=dict)
    device_bytes: int = 0
    total_bytes: int = 0
    free_bytes: int = 0

    @classmethod
    def of(cls, device: Device | None, gpu_blocks: int, spec: ShardSpec, report: list, model=None) -> Placement:
        """The placement of ``spec`` with its last ``gpu_blocks`` blocks on ``device`` (None: the CPU), with
        llama.cpp's ``buffer_report``. ``output_on_gpu`` is read from that report when ``model`` (its
        ``GGUFModelFile``) is given: llama.cpp keeps an output head on the CPU when the device cannot hold it as
        one buffer (lavapipe's storage buffers end at 128 MiB; Gemma's tied 170 MiB head stays on the CPU), so the
        device's model buffer must hold the blocks' weights and most of the head's."""
        buffers: dict[str, dict[str, int]] = {}
        for buft, what, size in report:
            buffers.setdefault(buft, {})
            buffers[buft][what] = buffers[buft].get(what, 0) + size
        split = spec.end - gpu_blocks
        on = device is not None and gpu_blocks > 0
        return cls(
            device=device.name if on else "CPU",
            description=device.description if on else "",
            backend=device.backend if on else "CPU",
            gpu_blocks=list(range(split, spec.end)) if on else [],
            cpu_blocks=list(range(spec.start, split)) if on else list(range(spec.start, spec.end)),
            output_on_gpu=on and spec.head and _holds_output(buffers.get(device.name, {}), gpu_blocks, spec, model),
            buffers=buffers,
            device_bytes=sum(sum(v.values()) for k, v in buffers.items() if on and k == device.name),
            total_bytes=device.total_bytes if on else 0,
            free_bytes=device.free_bytes if on else 0,
        )

    def summary(self) -> str:
        """One line: where the blocks run (``blocks 6-11 on Vulkan0 (llvmpipe ...), 0 on the CPU; 98.3 MiB
        there``)."""
        if not self.gpu_blocks:
            return f"all {len(self.cpu_blocks)} blocks on the CPU"
        where = f"blocks {self.gpu_blocks[0]}-{self.gpu_blocks[-1]} on {self.device} ({self.description})"
        cpu = f"{self.cpu_blocks[0]}-{self.cpu_blocks[-1]} on the CPU" if self.cpu_blocks else "none on the CPU"
        out = ", with the output head" if self.output_on_gpu else ""
        return f"{where}{out}, {cpu}; llama.cpp allocated {self.device_bytes / MIB:.1f} MiB there"

    def to_json(self) -> dict:
        return dict(self.__dict__)


__all__ = [
    "DEVICE_TYPES",
    "Device",
    "Placement",
    "buffer_report",
    "choose",
    "devices",
    "gpu_fit",
    "gpus",
    "load_model",
    "offload",
    "placement_now",
    "set_offload",
    "warm_up",
    "why_no_gpu",
]
