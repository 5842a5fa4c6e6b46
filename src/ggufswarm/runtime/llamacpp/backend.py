"""llama.cpp shard backend: one layer range run by llama.cpp's own graphs and kernels over its C API.

One llama.cpp context per shard; every route session is one sequence id in it (``n_seq_max``
sessions at most), each with its own KV stream of ``n_ctx_seq`` cells (llama.cpp's non-unified
KV, as llama-server's default): a session's attention never sees another's cells, so interleaved
sessions compute exactly what each would alone, and the node's KV budget is
``n_seq_max * n_ctx_seq`` tokens. Hidden states enter through ``llama_batch.embd`` (float32
``[n_tokens, n_embd]``); a non-head shard's output is its last block's ``l_out-{n-1}`` tensor,
copied out by a compiled eval callback (``_graph_tap.c``) that then stops the graph before the
output norm and LM head. The head shard returns llama.cpp's logits. Truncation is
``llama_memory_seq_rm``; snapshots are ``llama_state_seq_get_data`` / ``llama_state_seq_set_data``.

Recurrent shards (hybrid models such as ``qwen3next``: a layer range holding gated delta-net blocks) keep
a fixed-size state per session that llama.cpp cannot roll back partway (``llama_memory_seq_rm`` returns
false for any cut but "all"); so does ``deepseek4``'s compressed cache (``llama_kv_cache_dsv4::seq_rm``).
Such a shard (``exact_states_only``) truncates only to 0, to the current length, or to an exact
position it holds a *state checkpoint* of: the session's full sequence state (attention KV + recurrent
state) copied whenever it is serialized (``state_bytes``: at the node's snapshot positions, after the
sampled prefill and every ``--snapshot-every`` tokens, ``node/snapshots.py``) or loaded (``load_state``:
a restore from the cache). The last ``checkpoints`` of them are kept per session (host memory the
node's KV advertisement does not count). Any other truncation raises ``StateNotAtPosition`` (protocol
code ``state_not_at_position``, 409) naming the positions it can return to; route repair and prefix
reuse then fall back to recomputing from 0. Every node of a route snapshots at the same positions, and a
repaired route restores only a cache snapshot's position, so the survivors normally hold it.

The same context, batch splitting (``n_ubatch``) and thread count as llama.cpp's own full-model
run give bitwise-equal results: the tests compare 3-shard chains with ``llama_cpp.Llama``.

``kv_unified=True`` (the node's throughput mode, ``--batch-group`` above 3) puts every session's cells in one
KV stream instead (llama.cpp's unified KV): llama.cpp can then run the decode steps of *any* set of sessions as
one ubatch (with per-session streams it only takes consecutive sequence ids together, ``split_equal``), so a
node that is handed the steps of 8 of its 16 sessions reads its weights once, not once per run of consecutive
ids. Each session still attends only to its own cells (llama.cpp masks the others), but results are no longer
bitwise those of the session alone, and each step's attention walks the cells of all sessions.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import llama_cpp as L

from ...artifact.accounting import shard_account
from ...artifact.gguf_file import GGUFModelFile
from ..kv import ContextOverflow, KVPosition, TokenOutOfRange, check_max_length
from ..spec import ShardSpec
from . import _graph_tap
from .sampling import LlamaCppSampler
from .derive import (TokenEmbedding, UnsupportedShard, hidden_width, n_model_layers, n_vocab, recurrent_layers,
                     rules_for, shard_paths)

_BACKEND_READY = False
_BACKEND_LOCK = threading.Lock()
MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ, src/llama-cparams.h
STATE_FORMAT = "llama.cpp-seq-state-v1"
MAX_VERIFY_TOKENS = 16  # most tokens of a speculative verify step (all rows' logits) a head takes
SPLIT_KV_TOKENS = 256  # from this many tokens held a decode step attends to 512+ cells (see LlamaCppShard._solo)


class GraphTap(ctypes.Structure):
    """ctypes mirror of ``struct gs_tap`` in ``_graph_tap.c`` (same field order)."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
        ("filled", ctypes.c_size_t),
        ("stop", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("target", ctypes.c_char * 64),
    ]


_LOG_ERROR, _LOG_CONT = 4, 5  # enum ggml_log_level (ggml.h); llama-cpp-python's own filter predates this order
_log_state = {"error": False}


@L.llama_log_callback
def _log_errors_only(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log, errors only (and their continuation lines), to stderr."""
    if level != _LOG_CONT:
        _log_state["error"] = level == _LOG_ERROR
    if _log_state["error"]:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def _ensure_backend() -> None:
    """Initialise llama.cpp once per process and keep its log to errors only."""
    global _BACKEND_READY
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            L.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
            L.llama_backend_init()
            _BACKEND_READY = True


def _ggml_functions() -> tuple[int, int, int]:
    """Addresses of ggml_get_name, ggml_backend_tensor_get and ggml_nbytes in the ggml llama-cpp-python loaded."""
    lib_dir = Path(L.llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("ggml-base.*"))
    if not candidates:
        raise RuntimeError(f"cannot find ggml's base library next to llama-cpp-python ({lib_dir})")
    lib = ctypes.CDLL(str(candidates[0]))
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                 for name in ("ggml_get_name", "ggml_backend_tensor_get", "ggml_nbytes"))


class LlamaCppError(RuntimeError):
    """llama.cpp refused a call (model load, context creation, decode); the message says which and why."""


class KVCellsFull(LlamaCppError):
    """No room for a session: all sequence slots taken (``code`` kv_budget_full), a ``max_length`` over
    the cells of one session (kv_budget_too_small), or no free KV cells for a step."""

    def __init__(self, message: str, code: str = "kv_budget_full"):
        super().__init__(message)
        self.code = code


class StateNotAtPosition(LlamaCppError):
    """A shard that truncates only to exact states (recurrent blocks, ``deepseek4``) was asked for a position it
    holds no state checkpoint of (``code`` state_not_at_position); the session is unchanged."""

    code = "state_not_at_position"


@dataclass(frozen=True)
class ShardModelInfo:
    """What the node and clients need to know of the model a llama.cpp shard belongs to."""

    arch: str
    n_layers: int          # blocks a route covers (MTP/nextn blocks excluded)
    n_embd: int            # values per token of a hidden state between shards (derive.hidden_width)
    n_vocab: int
    context_length: int    # trained context (tokens)

    @property
    def max_length(self) -> int:
        """Longest session this model allows: min(trained context, 128K cap)."""
        return min(self.context_length, 131072)


def model_info(model: GGUFModelFile) -> ShardModelInfo:
    """ShardModelInfo from a GGUF header; UnsupportedShard for an architecture outside the table."""
    arch = model.architecture
    rules_for(arch)
    md = model.metadata
    return ShardModelInfo(arch, n_model_layers(model), hidden_width(model), n_vocab(model),
                          int(md.get(f"{arch}.context_length", 4096)))


def kv_bytes_per_token(model: GGUFModelFile, spec: ShardSpec) -> int:
    """f16 KV bytes one token costs in llama.cpp's cache over blocks ``[spec.start, spec.end)``.

    From the GGUF header alone: ``artifact.accounting`` (per-layer KV head counts × key/value lengths,
    as ``src/llama-kv-cache.cpp`` sizes each cell; the MLA latent; 0 for recurrent layers, whose fixed
    per-session state is ``ShardAccount.state_bytes_per_session``).
    """
    return shard_account(model, spec.start, spec.end).kv_bytes_per_token


class SeqKV(KVPosition):
    """One session's KV cache on a llama.cpp shard: a sequence id of the shard's context.

    ``length``: tokens held (= position of the next token); ``epoch`` is bumped by every
    truncate/restore. Same contract as ``runtime.kv.SessionKV``.
    """

    def __init__(self, shard: "LlamaCppShard", seq_id: int, max_length: int):
        self.shard = shard
        self.seq_id = seq_id
        self.max_length = check_max_length(max_length)
        self.length = 0
        self.epoch = 0
        self.closed = False
        # exact-state shards: position -> the sequence state (llama_state_seq_get_data bytes) at exactly that
        # position, oldest first, at most shard.checkpoints of them
        self.checkpoints: dict[int, bytes] = {}

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` tokens (``llama_memory_seq_rm``); ValueError past the end.

        On an exact-state shard (``shard.exact_states_only``) only to 0, ``length`` itself, or a position in
        ``checkpoints`` (the state there is loaded); StateNotAtPosition otherwise (the session is unchanged).
        LlamaCppError when llama.cpp refuses a checkpoint (the session is then empty)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: session holds {self.length} tokens")
        if self.shard.exact_states_only and 0 < length < self.length:
            state = self.checkpoints.get(length)
            if state is None:
                raise StateNotAtPosition(
                    f"this shard's state cannot be rolled back to {length} tokens (llama.cpp keeps one recurrent or "
                    f"compressed state per session); exact state checkpoints held: {sorted(self.checkpoints) or 'none'}")
            try:
                self.shard._set_state(self, state, length)
            except LlamaCppError:  # llama.cpp refused its own state: the sequence is empty now
                self.length, self.checkpoints = 0, {}
                self.epoch += 1
                raise
        else:
            self.shard._seq_rm(self.seq_id, length)
        self.length = length
        self.epoch += 1
        for pos in [p for p in self.checkpoints if p > length]:
            del self.checkpoints[pos]

    def checkpoint(self, state: bytes) -> None:
        """Keep ``state`` (this session's sequence state at ``length`` tokens) as a truncation target (exact-state
        shards only; the oldest is dropped past ``shard.checkpoints``)."""
        if self.shard.exact_states_only and self.length and self.shard.checkpoints:
            self.checkpoints.pop(self.length, None)
            self.checkpoints[self.length] = state
            while len(self.checkpoints) > self.shard.checkpoints:
                del self.checkpoints[next(iter(self.checkpoints))]

    def nbytes(self) -> int:
        """KV bytes this session's tokens occupy in the context."""
        return self.length * self.shard.kv_bytes_per_token()

    def close(self) -> None:
        """Free the sequence's KV cells and its id (idempotent)."""
        if not self.closed:
            self.closed = True
            self.checkpoints = {}
            self.shard._release(self.seq_id)

    def __del__(self):  # a session dropped without close() (e.g. expired) still frees its cells
        try:
            self.close()
        except Exception:
            pass


class LlamaCppShard:
    """Runs blocks ``[spec.start, spec.end)`` (plus embedding and/or head stage) through llama.cpp.

    ``n_ctx_seq``: KV cells of each session (its longest ``max_length``, tokens; llama.cpp rounds
    it up to a multiple of 256); ``n_seq_max``: most sessions at once;
    ``n_batch``: most tokens in one step (bigger steps are refused); ``n_ubatch``: llama.cpp's
    physical batch (512 as in llama.cpp's defaults: keep equal to the reference run for bitwise
    results); ``threads``: llama.cpp decode and batch threads; ``cache_dir``: where derived shard
    GGUFs are written; ``all_logits``: the head will be asked for every position's logits
    (perplexity) — otherwise its compute buffer is sized for one output row; ``checkpoints``: exact-position
    state checkpoints kept per session on a shard llama.cpp cannot truncate partway (``exact_states_only``:
    the range holds recurrent blocks, or the architecture's cache refuses partial removal, ``deepseek4``;
    see the module docstring), each ``state_bytes_per_session`` plus the attention KV of its tokens;
    ``kv_unified``: all sessions' cells in one KV stream (any sessions batch together, not bitwise; the module
    docstring), a session still holding at most ``n_ctx_seq`` of them; ``in_place``: load the layers from the model's
    own files (a shard header and the model files, llama.cpp patch 0004; default when the loaded libllama has it)
    or from a derived copy (``derive.shard_paths``).

    Raises UnsupportedShard (architecture/range), LlamaCppError (llama.cpp refused the file or
    the context), ValueError (bad parameters).
    """

    backend = "llama.cpp"  # ShardBackend capabilities (runtime/backends.py); the limits are set per instance
    supports_batch = True
    step_grouping_matters = True
    sampler_class = LlamaCppSampler  # the head draws with llama.cpp's sampler chain
    # forward_batch: most sessions whose decode steps share one graph evaluation (a ubatch). Up to 3 keeps every
    # session's result bitwise equal to its step run alone: llama.cpp's CPU matmul switches from gemv to gemm at
    # 4 rows (ggml-cpu/repack.cpp), which rounds differently (and with more than one thread a session of 256+
    # tokens then gets a ubatch of its own: _solo). More is faster, and no longer bitwise.
    batch_group: int = 3

    def __init__(self, model: GGUFModelFile, spec: ShardSpec, *, n_ctx_seq: int = 4096, n_seq_max: int = 4,
                 n_batch: int = 2048, n_ubatch: int = 512, threads: int | None = None,
                 cache_dir: str | os.PathLike | None = None, all_logits: bool = False, checkpoints: int = 4,
                 kv_unified: bool = False, in_place: bool | None = None):
        self.model = model
        self.cfg = model_info(model)
        spec.validate(self.cfg.n_layers)
        if spec.start == spec.end:
            raise UnsupportedShard("the llama.cpp backend runs at least one block per shard")
        if not 1 <= n_seq_max <= MAX_SEQUENCES:
            raise ValueError(f"n_seq_max must be in 1..{MAX_SEQUENCES}, got {n_seq_max}")
        self.spec = spec
        self.n_batch = n_batch
        self.threads = threads or max(1, os.cpu_count() or 1)
        _ensure_backend()
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "ggufswarm" / "shards")
        # The whole model with its head runs from the original file and takes token ids directly.
        self.takes_tokens = spec.embed and spec.head
        # the shard's header and the model's own files (read in place, patch 0004), or one derived copy
        self.paths = shard_paths(model, spec.start, spec.end, spec.head, cache_dir, in_place)
        self.path = self.paths[0]
        self.embedding = TokenEmbedding(model) if spec.embed and not spec.head else None
        self._lock = threading.RLock()  # reentrant: SeqKV.__del__ may run inside a step
        self._free_seqs = list(range(n_seq_max))  # a heap: the lowest free id first (keeps ids consecutive)
        self._kv_bytes = kv_bytes_per_token(model, spec)
        recr = recurrent_layers(model)
        # llama.cpp cannot roll this shard's sessions back partway: recurrent blocks, or a cache that refuses it
        self.exact_states_only = bool(recr and any(recr[spec.start:spec.end])) or rules_for(model.architecture).exact_states
        self.checkpoints = max(0, int(checkpoints))

        mparams = L.llama_model_default_params()
        mparams.use_mmap = True
        if len(self.paths) == 1:
            self._model = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        else:
            names = (ctypes.c_char_p * len(self.paths))(*[str(p).encode() for p in self.paths])
            self._model = L.llama_model_load_from_splits(names, len(self.paths), mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {self.path} (see its error above)")
        rules = rules_for(model.architecture)
        # hidden states in and out: n_embd values per token, or hc_mult residual streams of n_embd (DeepSeek-V4)
        n_embd = self.cfg.n_embd
        streams = rules.streams(model.metadata) if rules.streams else 1
        if L.llama_model_n_embd(self._model) * streams != n_embd:
            raise LlamaCppError(f"{self.path}: n_embd {L.llama_model_n_embd(self._model)} x {streams}, "
                                f"expected {n_embd}")
        self.streams = streams
        # the graph reads each token's id with its hidden states (hash-routed blocks): forward(token_ids=...)
        self.needs_token_ids = rules.token_ids and not self.takes_tokens
        cparams = L.llama_context_default_params()
        # unified KV: every session may hold its n_ctx_seq rounded up as llama.cpp rounds a stream's (256 cells)
        per_session = -(-n_ctx_seq // 256) * 256 if kv_unified else n_ctx_seq
        cparams.n_ctx = per_session * n_seq_max
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_ubatch, n_batch)
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.kv_unified = self.kv_unified = bool(kv_unified)  # False: one KV stream per session (module docstring)
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # llama.cpp's CPU default (auto -> on)
        cparams.swa_full = True  # sliding-window layers keep every position, so truncate is exact
        cparams.no_perf = True
        # outputs llama.cpp may return per ubatch (sizes the LM head's compute buffer: 512 x n_vocab floats would
        # be 512 MiB for Gemma); llama.cpp asserts it is at least n_seq_max (src/llama-context.cpp output_reserve)
        # a head also returns every row of a speculative verify step (up to MAX_VERIFY_TOKENS: 16 x n_vocab floats)
        self.max_outputs = n_batch if all_logits or not spec.head else min(max(n_seq_max, MAX_VERIFY_TOKENS), n_batch)
        cparams.n_outputs_max = self.max_outputs
        self._tap = None
        if not spec.head:
            self._capture = np.empty((n_batch, n_embd), dtype=np.float32)
            get_name, tensor_get, nbytes = _ggml_functions()
            if ctypes.sizeof(GraphTap) != _graph_tap.tap_size():
                raise LlamaCppError("graph tap struct mismatch: rebuild the package (pip install -e .)")
            self._tap = GraphTap(get_name, tensor_get, nbytes, self._capture.ctypes.data, self._capture.nbytes,
                                 0, 1, 0, f"{rules.tap}-{spec.end - spec.start - 1}".encode())
            cparams.cb_eval = L.ggml_backend_sched_eval_callback(_graph_tap.callback_address())
            cparams.cb_eval_user_data = ctypes.addressof(self._tap)
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise LlamaCppError(f"llama.cpp could not create a context (n_ctx_seq {n_ctx_seq}, n_seq_max {n_seq_max})")
        # cells one session may hold: its stream, or with unified KV (where llama.cpp's n_ctx_seq is the whole
        # context) the same share of the one stream
        self.n_ctx_seq = per_session if self.kv_unified else L.llama_n_ctx_seq(self._ctx)
        self.n_seq_max = n_seq_max
        self.n_ubatch = cparams.n_ubatch
        self._mem = L.llama_get_memory(self._ctx)
        self.n_vocab_out = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        self._batch = L.llama_batch_init(n_batch, 0 if self.takes_tokens else n_embd, 1)
        # a batch of hidden states that also carries token ids: our buffer (set to NULL again before llama_batch_free)
        self._token_ids = np.zeros(n_batch, dtype=np.int32) if self.needs_token_ids else None
        if self._token_ids is not None:
            self._batch.token = self._token_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        # M-RoPE / IMRoPE models (qwen35moe) take 4 positions per token; llama.cpp expands a token batch's one
        # position to [p, p, p, 0] itself (llm_graph_input_pos::set_input) but reads an embedding batch's four,
        # section-major (pos[j * n_tokens + i], src/llama-batch.cpp): our buffer replaces the batch's 1-wide one
        rope = L.llama_model_rope_type(self._model)
        self.n_pos_per_token = 4 if not self.takes_tokens and rope in (L.LLAMA_ROPE_TYPE_MROPE,
                                                                       L.LLAMA_ROPE_TYPE_IMROPE) else 1
        self._batch_pos = ctypes.cast(self._batch.pos, ctypes.c_void_p).value  # the one llama_batch_free frees
        if self.n_pos_per_token > 1:
            self._pos_buffer = np.zeros(n_batch * self.n_pos_per_token, dtype=np.int32)
            self._batch.pos = self._pos_buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            self._pos = self._pos_buffer
        else:
            self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_batch,))
        self._n_seq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(n_batch,))
        self._n_seq[:] = 1

    @property
    def step_lock(self) -> threading.RLock:
        """The lock every step, truncate and state call of this shard holds (llama.cpp's context is not
        thread-safe): a caller that acquires it without blocking knows its step will not wait."""
        return self._lock

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs on this shard (all its layers, keys and values, f16)."""
        return self._kv_bytes

    # -- sessions ------------------------------------------------------------------------------
    def vocab(self):
        """llama.cpp's vocabulary of this shard's model (``llama_vocab *``; a head shard carries the real one)."""
        return L.llama_model_get_vocab(self._model)

    def new_session(self, max_length: int) -> SeqKV:
        """A new sequence id for a session.

        Raises ContextOverflow past the 128K cap, KVCellsFull when ``max_length`` exceeds ``n_ctx_seq``
        or all ``n_seq_max`` sequence ids are taken."""
        check_max_length(max_length)
        if max_length > self.n_ctx_seq:
            raise KVCellsFull(f"max_length {max_length} exceeds this shard's {self.n_ctx_seq} KV cells per session "
                              f"(node --ctx-size)", "kv_budget_too_small")
        with self._lock:
            if not self._free_seqs:
                raise KVCellsFull(f"all {self.n_seq_max} session slots of this shard are in use")
            seq = heapq.heappop(self._free_seqs)
        return SeqKV(self, seq, max_length)

    def _seq_rm(self, seq_id: int, start: int) -> None:
        with self._lock:
            if not L.llama_memory_seq_rm(self._mem, seq_id, start, -1):
                raise LlamaCppError(f"llama.cpp cannot truncate sequence {seq_id} to {start} tokens")

    def _release(self, seq_id: int) -> None:
        if not getattr(self, "_ctx", None):
            return
        with self._lock:
            L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            heapq.heappush(self._free_seqs, seq_id)

    # -- steps ---------------------------------------------------------------------------------
    def forward(self, kv: SeqKV, inputs, logits: str = "last", token_ids=None) -> np.ndarray:
        """Run one prefill (T > 1) or decode (T = 1) step of a session.

        ``inputs`` (a numpy array, or anything ``numpy.asarray`` takes: a list, a CPU torch tensor): token ids
        ``[T]`` (int) when the shard has the embedding stage, else hidden states ``[T, n_embd]`` (float,
        converted to float32; ``n_embd`` is ``cfg.n_embd``, the width between shards). Returns numpy float32
        hidden states ``[T, n_embd]`` (the last block's output), or at the head float32 logits ``[1, n_vocab]``
        (``logits="last"``) or ``[T, n_vocab]`` (``"all"``). ``token_ids``: int ``[T]``, the step's token ids,
        required by a shard whose graph reads them with the hidden states (``needs_token_ids``: DeepSeek-V4's
        hash-routed blocks), ignored otherwise.

        Raises ContextOverflow past ``max_length``, ValueError for wrong shapes / ids / a step over
        ``n_batch`` tokens or missing ``token_ids``, KVCellsFull when the context has no free cells, LlamaCppError
        when llama.cpp fails; on any error the session's KV cache is as before the call.
        """
        inputs = np.asarray(inputs)
        ids, embd, tok = self._check_step(kv, inputs, token_ids)
        n_tokens = int(inputs.shape[0])
        if self.spec.head and logits == "all" and n_tokens > self.max_outputs:
            raise ValueError(f"this head returns at most {self.max_outputs} rows of logits per step "
                             f"(load it with all_logits=True for perplexity)")
        all_out = not self.spec.head or logits == "all"
        with self._lock:
            batch = self._batch
            batch.n_tokens = n_tokens
            positions = np.arange(kv.length, kv.length + n_tokens, dtype=np.int32)
            if self.n_pos_per_token == 4:  # text positions as llama.cpp writes them for tokens: [p, p, p, 0]
                self._pos[:3 * n_tokens] = np.tile(positions, 3)
                self._pos[3 * n_tokens:4 * n_tokens] = 0
            else:
                self._pos[:n_tokens] = positions
            for i in range(n_tokens):
                batch.seq_id[i][0] = kv.seq_id
            self._out[:n_tokens] = 1 if all_out else 0
            self._out[n_tokens - 1] = 1
            if embd is None:
                ctypes.memmove(batch.token, ids.ctypes.data, n_tokens * 4)
            else:
                embd = np.ascontiguousarray(embd, dtype=np.float32)
                ctypes.memmove(batch.embd, embd.ctypes.data, embd.nbytes)
                if tok is not None:
                    self._token_ids[:n_tokens] = tok
            if self._tap is not None:
                self._tap.filled = 0
                self._tap.overflow = 0
            rc = L.llama_decode(self._ctx, batch)
            if rc == 1:
                raise KVCellsFull(f"no free KV cells for {n_tokens} tokens ({self.n_ctx_seq} cells per session)")
            if rc != 0:
                raise LlamaCppError(f"llama_decode failed with code {rc}")
            if self._tap is not None:
                got = self._tap.filled // (4 * self.cfg.n_embd)
                if self._tap.overflow or got != n_tokens:
                    L.llama_memory_seq_rm(self._mem, kv.seq_id, kv.length, -1)
                    raise LlamaCppError(f"captured {got} hidden-state rows for {n_tokens} tokens "
                                        f"(tensor {self._tap.target.decode()})")
                out = self._capture[:n_tokens].copy()
            elif logits == "all":
                ptr = L.llama_get_logits(self._ctx)
                out = np.ctypeslib.as_array(ptr, shape=(n_tokens, self.n_vocab_out)).copy()
            else:
                ptr = L.llama_get_logits_ith(self._ctx, -1)
                out = np.ctypeslib.as_array(ptr, shape=(1, self.n_vocab_out)).copy()
            kv.length += n_tokens
        return out

    def _check_step(self, kv: SeqKV, inputs: np.ndarray, token_ids=None):
        """Validate one step (``inputs`` a numpy array) as ``forward`` does; (ids int32 [T] for a shard that takes
        token ids itself, else None; embd float32 [T, n_embd] or None; token ids int32 [T] to pass with ``embd``
        (``needs_token_ids``) or None)."""
        if kv.closed or kv.shard is not self:
            raise ValueError("session is closed or belongs to another shard")
        n_tokens = int(inputs.shape[0]) if inputs.ndim else 0
        if n_tokens == 0:
            raise ValueError("a step needs at least one token")
        if n_tokens > self.n_batch:
            raise ValueError(f"a step holds at most {self.n_batch} tokens on this shard, got {n_tokens}")
        kv.reserve(n_tokens)
        if self.spec.embed:
            if inputs.ndim != 1 or inputs.dtype.kind not in "iu":
                raise ValueError(f"the first shard takes integer token ids [n_tokens], got {inputs.dtype} "
                                 f"{tuple(inputs.shape)}")
            ids = inputs.astype(np.int32, copy=False)
            if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.n_vocab:
                raise TokenOutOfRange(f"token id out of range [0, {self.cfg.n_vocab})")
            if self.takes_tokens:
                return ids, None, None
            embd = self.embedding(ids)
            if self.streams > 1:  # the embedding copied into every residual stream, as llama.cpp's ggml_repeat_4d
                embd = np.tile(embd, (1, self.streams))
            return None, embd, ids if self.needs_token_ids else None
        if inputs.ndim != 2 or inputs.shape[1] != self.cfg.n_embd:
            raise ValueError(f"expected hidden states [n_tokens, {self.cfg.n_embd}], got {tuple(inputs.shape)}")
        tok = None
        if self.needs_token_ids:
            if token_ids is None:
                raise ValueError(f"this {self.cfg.arch} shard routes blocks by token id: a step of hidden states "
                                 f"must carry its token ids")
            tok = np.asarray(token_ids).astype(np.int32, copy=False).reshape(-1)
            if tok.shape[0] != n_tokens:
                raise ValueError(f"{tok.shape[0]} token ids for {n_tokens} hidden states")
            if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= self.cfg.n_vocab):
                raise TokenOutOfRange(f"token id out of range [0, {self.cfg.n_vocab})")
        return None, inputs, tok

    def forward_batch(self, steps: list[tuple]) -> list[np.ndarray | Exception]:
        """Run one step of each of several sessions; the decode steps (T = 1) together in one ``llama_decode``.

        ``steps``: ``(kv, inputs)`` or ``(kv, inputs, token_ids)`` of *different* sessions, as for ``forward``. Returns one
        entry per step, in order: what ``forward`` would return (hidden states ``[T, n_embd]`` float32, at the
        head the last position's logits ``[1, n_vocab]`` float32), or the exception that step raised (the
        others are unaffected; on an error a session's KV cache is as before the call).

        The single-token steps go into one ``llama_batch``, one sequence id each, sorted by sequence id:
        with non-unified KV llama.cpp splits such a batch into ubatches of *consecutive* sequence ids
        (``split_equal``, sequential), so sessions whose ids are consecutive share one graph evaluation, at most
        ``batch_group`` of them (``_grouped``; up to 3, and a long session alone with several threads (``_solo``),
        each result is bitwise what ``forward`` gives for that step alone).
        Steps of more than one token run one after another through ``forward`` (their ubatch split is then
        the one they get alone). When llama.cpp fails the shared decode (no free cells, an abort), it has
        rolled every sequence back and each of those steps is run again alone, with its own result or error.
        ValueError when two steps belong to the same session.
        """
        if len({id(step[0]) for step in steps}) != len(steps):
            raise ValueError("forward_batch takes at most one step per session")
        if self.exact_states_only or self.n_pos_per_token != 1 or self.needs_token_ids:
            # recurrent state, multi-position (M-RoPE) and token-id batches are not checked against llama.cpp alone
            return [self._forward_one(step[0], np.asarray(step[1]), *step[2:]) for step in steps]
        steps = [(step[0], np.asarray(step[1])) for step in steps]
        results: list = [None] * len(steps)
        decode = []  # (seq_id, index, kv, ids, embd)
        for i, (kv, inputs) in enumerate(steps):
            if int(inputs.shape[0]) != 1:
                continue
            try:
                ids, embd, _ = self._check_step(kv, inputs)
            except Exception as exc:  # noqa: BLE001 - that step's error, the others go on
                results[i] = exc
                continue
            decode.append((kv.seq_id, i, kv, ids, embd))
        if len(decode) == 1:  # nothing to share a decode with
            _, i, kv, _, _ = decode[0]
            results[i] = self._forward_one(kv, steps[i][1])
        elif decode:
            decode = self._grouped(decode)
            try:
                outs = self._decode_together(decode)
            except LlamaCppError:  # llama.cpp rolled the whole batch back: each step alone
                outs = [self._forward_one(kv, steps[i][1]) for _, i, kv, _, _ in decode]
            for (_, i, _, _, _), out in zip(decode, outs):
                results[i] = out
        for i, (kv, inputs) in enumerate(steps):
            if int(inputs.shape[0]) != 1:
                results[i] = self._forward_one(kv, inputs)
        return results

    def _grouped(self, decode: list) -> list:
        """``decode`` ordered so that llama.cpp's sequential ``split_equal`` makes each ubatch one group of at most
        ``batch_group`` consecutive sequence ids: sorted by id, cut into groups, the groups in descending order
        (a ubatch takes the first unused token's sequence and then ids +1, +2, ... found later in the batch; the
        next id after a group's last is absent or in a group placed before it, already used)."""
        decode = sorted(decode, key=lambda d: d[0])
        if self.kv_unified:  # one stream: llama.cpp takes any sequences into a ubatch
            return decode
        groups, run = [], []
        for d in decode:
            if run and (d[0] != run[-1][0] + 1 or len(run) >= self.batch_group or self._solo(run[-1][2])
                        or self._solo(d[2])):
                groups.append(run)
                run = []
            run.append(d)
        groups.append(run)
        return [d for g in reversed(groups) for d in g]

    def _solo(self, kv: SeqKV) -> bool:
        """Whether this session's decode step must have a ubatch of its own to stay bitwise its step alone: with
        more than one thread, llama.cpp's CPU flash attention splits the KV cells among the threads only for a
        ubatch of one sequence holding 512+ cells (``use_split_kv_path``, ggml-cpu/ops.cpp; llama.cpp pads the
        cells it attends to to 256, so from 256 tokens on), which rounds differently from the unsplit path a
        multi-sequence ubatch takes. Only in the exact mode (``batch_group`` <= 3)."""
        return self.batch_group <= 3 and self.threads > 1 and kv.length >= SPLIT_KV_TOKENS

    def _forward_one(self, kv: SeqKV, inputs: np.ndarray, token_ids=None) -> np.ndarray | Exception:
        try:
            return self.forward(kv, inputs, token_ids=token_ids)
        except Exception as exc:  # noqa: BLE001
            return exc

    def _decode_together(self, decode: list) -> list[np.ndarray]:
        """One ``llama_decode`` of single-token steps ``(seq_id, index, kv, ids, embd)`` sorted by sequence id;
        their outputs in that order. LlamaCppError (every sequence rolled back) when llama.cpp fails it."""
        n = len(decode)
        with self._lock:
            batch = self._batch
            batch.n_tokens = n
            for j, (seq, _, kv, ids, embd) in enumerate(decode):
                self._pos[j] = kv.length
                batch.seq_id[j][0] = seq
                if ids is not None:
                    batch.token[j] = int(ids[0])
                else:
                    row = np.ascontiguousarray(embd, dtype=np.float32)
                    ctypes.memmove(ctypes.addressof(batch.embd.contents) + j * row.nbytes, row.ctypes.data, row.nbytes)
            self._out[:n] = 1
            if self._tap is not None:
                self._tap.filled = 0
                self._tap.overflow = 0
            rc = L.llama_decode(self._ctx, batch)
            if rc != 0:
                raise LlamaCppError(f"llama_decode of {n} sessions' steps failed with code {rc}")
            if self._tap is not None:
                got = self._tap.filled // (4 * self.cfg.n_embd)
                if self._tap.overflow or got != n:
                    for seq, _, kv, _, _ in decode:
                        L.llama_memory_seq_rm(self._mem, seq, kv.length, -1)
                    raise LlamaCppError(f"captured {got} hidden-state rows for {n} tokens "
                                        f"(tensor {self._tap.target.decode()})")
                rows = self._capture[:n].copy()
                outs = [rows[j:j + 1] for j in range(n)]
            else:
                outs = [np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, j), shape=(1, self.n_vocab_out)).copy()
                        for j in range(n)]
            for _, _, kv, _, _ in decode:
                kv.length += 1
        return outs

    # -- snapshots -----------------------------------------------------------------------------
    def state_bytes(self, kv: SeqKV) -> bytes:
        """The session's KV cells as llama.cpp serializes them (``llama_state_seq_get_data``)."""
        with self._lock:
            size = L.llama_state_seq_get_size(self._ctx, kv.seq_id)
            buf = (ctypes.c_uint8 * size)()
            got = L.llama_state_seq_get_data(self._ctx, buf, size, kv.seq_id)
        if got != size:
            raise LlamaCppError(f"llama.cpp wrote {got} of {size} state bytes")
        data = bytes(buf)
        kv.checkpoint(data)
        return data

    def _set_state(self, kv: SeqKV, data: bytes, n_tokens: int) -> None:
        """Load a sequence state holding exactly ``n_tokens`` tokens into ``kv``'s sequence (LlamaCppError, the
        sequence then empty, when llama.cpp rejects it); does not touch ``kv.length``."""
        src = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        with self._lock:
            L.llama_memory_seq_rm(self._mem, kv.seq_id, -1, -1)
            got = L.llama_state_seq_set_data(self._ctx, src, len(data), kv.seq_id)
            held = L.llama_memory_seq_pos_max(self._mem, kv.seq_id) + 1
            if got == 0 or held != n_tokens:
                L.llama_memory_seq_rm(self._mem, kv.seq_id, -1, -1)
                raise LlamaCppError(f"llama.cpp rejected the state ({len(data)} bytes; holds {held} tokens, "
                                    f"expected {n_tokens})")

    def load_state(self, kv: SeqKV, data: bytes, n_tokens: int) -> None:
        """Replace the session's KV with a state from ``state_bytes`` holding ``n_tokens`` tokens.

        Raises ContextOverflow past ``max_length`` and LlamaCppError when llama.cpp rejects the data
        (the session is then empty).
        """
        if n_tokens > kv.max_length:
            raise ContextOverflow(f"snapshot holds {n_tokens} tokens; the session's max_length is {kv.max_length}")
        kv.epoch += 1
        kv.checkpoints = {}
        try:
            self._set_state(kv, data, n_tokens)
        except LlamaCppError:
            kv.length = 0
            raise
        kv.length = n_tokens
        kv.checkpoint(data)

    def close(self) -> None:
        """Free the context, batch and model (idempotent)."""
        if getattr(self, "_ctx", None):
            self._batch.pos = ctypes.cast(self._batch_pos, ctypes.POINTER(ctypes.c_int32))
            if self._token_ids is not None:
                self._batch.token = ctypes.POINTER(ctypes.c_int32)()
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = ["kv_bytes_per_token", "KVCellsFull", "LlamaCppError", "LlamaCppShard", "STATE_FORMAT", "SeqKV", "ShardModelInfo",
           "StateNotAtPosition",
           "UnsupportedShard", "model_info"]
