"""ctypes glue between the llama.cpp backend and the libraries llama-cpp-python loaded: one-time backend
initialisation, the errors-only log callback, and the compiled graph tap (``_graph_tap.c``) that copies a
shard's last block output out of llama.cpp's graph."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from pathlib import Path

import numpy as np

from . import _graph_tap
from .bindings import L
from .errors import LlamaCppError

_BACKEND_READY = False
_BACKEND_LOCK = threading.Lock()
_LOG_ERROR, _LOG_CONT = 4, 5  # enum ggml_log_level (ggml.h); llama-cpp-python's own filter predates this order
_log_state = {"error": False}
TRIM_PATCH = "0012-compute-buffers-given-back-when-idle"  # adds llama_trim_compute_buffers
TAP_TARGET_BYTES = 64  # gs_tap.target in _graph_tap.c: the tapped tensor's name, NUL-terminated


class GraphTap(ctypes.Structure):
    """ctypes mirror of ``struct gs_tap`` in ``_graph_tap.c`` (same field order).

    ``dst``/``capacity``: the caller's float32 buffer and its size in bytes; ``filled``: bytes copied by the
    last graph evaluation(s); ``overflow``: set when a copy did not fit; ``target``: the tensor name to copy
    (e.g. ``l_out-5``); ``stop``: end the graph after copying it."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("filled", ctypes.c_size_t),
        ("stop", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("target", ctypes.c_char * TAP_TARGET_BYTES),
    ]

    def reset(self) -> None:
        """Forget what the last decode copied (before the next ``llama_decode``)."""
        self.filled = 0
        self.overflow = 0

    def rows(self, width: int) -> int:
        """Rows of ``width`` float32 values the last decode copied."""
        return self.filled // (4 * width)


@L.llama_log_callback
def _log_errors_only(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log, errors only (and their continuation lines), to stderr; every line also to the list
    ``capture_log`` holds open."""
    line = text.decode("utf-8", errors="replace")
    captured = _log_state.get("capture")
    if captured is not None:
        captured.append(line)
    if level != _LOG_CONT:
        _log_state["error"] = level == _LOG_ERROR
    if _log_state["error"]:
        sys.stderr.write(line)


@contextlib.contextmanager
def capture_log():
    """Every line llama.cpp logs while the block runs (any level), as a list of strings (callers serialise)."""
    ensure_backend()
    lines: list[str] = []
    _log_state["capture"] = lines
    try:
        yield lines
    finally:
        _log_state["capture"] = None


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and keep its log to errors only."""
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            L.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
            L.llama_backend_init()
            _BACKEND_READY = True


def ggml_functions() -> tuple[int, int, int]:
    """Addresses of ggml_get_name, ggml_backend_tensor_get and ggml_nbytes in the ggml llama-cpp-python loaded.
    RuntimeError when its ggml base library is not where llama-cpp-python keeps it (its ``lib`` folder, or the folder
    ``LLAMA_CPP_LIB_PATH`` names: llama-cpp-python loads its libraries from there when set)."""
    lib_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(L.__file__).parent / "lib")
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
    if not candidates:
        raise RuntimeError(f"cannot find ggml's base library next to llama-cpp-python ({lib_dir})")
    lib = ctypes.CDLL(str(candidates[0]))
    return tuple(
        ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        for name in ("ggml_get_name", "ggml_backend_tensor_get", "ggml_nbytes")
    )


def graph_tap(capture: np.ndarray, target: str) -> GraphTap:
    """A tap that copies tensor ``target`` into ``capture`` (a C-contiguous float32 array, kept alive by the
    caller) and stops the graph there. LlamaCppError when the compiled tap does not match this mirror."""
    if ctypes.sizeof(GraphTap) != _graph_tap.tap_size():
        raise LlamaCppError("graph tap struct mismatch: rebuild the package (pip install -e .)")
    get_name, tensor_get, nbytes = ggml_functions()
    return GraphTap(get_name, tensor_get, nbytes, capture.ctypes.data, capture.nbytes, 0, 1, 0, target.encode())


def install_tap(cparams, tap: GraphTap) -> None:
    """Make ``tap`` the eval callback of a context created with ``cparams`` (``llama_context_params``)."""
    cparams.cb_eval = L.ggml_backend_sched_eval_callback(_graph_tap.callback_address())
    cparams.cb_eval_user_data = ctypes.addressof(tap)


@functools.cache
def _trim_function():
    """libllama's ``llama_trim_compute_buffers`` (patch 0012) as a ctypes function; None without the patch."""
    from .patches import applied

    if not applied(TRIM_PATCH):
        return None
    fn = L._lib.llama_trim_compute_buffers
    fn.argtypes, fn.restype = [ctypes.c_void_p], None
    return fn


def trim_compute_buffers(ctx) -> bool:
    """Clear context ``ctx``'s compute buffers (``llama_trim_compute_buffers``, patch 0012): a CPU buffer gives its
    pages back to the OS (patch 0010), resident again as the next decode writes them; results unchanged. The caller
    holds the context's lock: no decode may run meanwhile. Whether it ran (False: a libllama without the patch)."""
    trim = _trim_function()
    if trim is None:
        return False
    trim(ctx)
    return True


_MADV_DONTNEED = 4  # <sys/mman.h> (Linux)


def give_back_pages(address: int, nbytes: int) -> None:
    """Give the whole pages of ``nbytes`` bytes at ``address`` (a buffer of this process it writes in full before
    reading: a step's hidden states) back to the OS (``madvise(MADV_DONTNEED)``): they read as zeros and are
    resident again once written. Nothing where there is no ``madvise`` (not Linux) or no whole page."""
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-address // page) * page, (address + nbytes) // page * page
    if (madvise := _madvise()) is not None and end > start:
        madvise(start, end - start, _MADV_DONTNEED)


@functools.cache
def _madvise():
    """libc's ``madvise`` as a ctypes function; None where there is none (not Linux)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None) if sys.platform == "linux" else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


__all__ = [
    "GraphTap",
    "ensure_backend",
    "ggml_functions",
    "give_back_pages",
    "graph_tap",
    "install_tap",
    "trim_compute_buffers",
]
