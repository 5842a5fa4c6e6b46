"""llama.cpp shard backend: one layer range run by llama.cpp's own graphs and kernels over its C API.

One context per shard; each route session is one sequence id with its own KV stream (non-unified KV, as
llama-server's default), so interleaved sessions compute exactly what each would alone. Hidden states enter through
``llama_batch.embd`` (float32 ``[n_tokens, n_embd]``); a non-head shard's output is its last block's ``l_out-{n-1}``,
copied out by a compiled eval callback (``ffi.graph_tap``); the head returns llama.cpp's logits. The same context,
ubatch and threads as llama.cpp's own full-model run give bitwise-equal results (docs/design.md, "Backends";
``kv_unified=True``, the throughput mode, is not bitwise: docs/protocol.md, "How a node schedules steps").
"""

from __future__ import annotations

import ctypes
import heapq
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from ...artifact.accounting import shard_account
from ...artifact.gguf_file import GGUFModelFile
from ...artifact.planning import GPU_SESSION_CELLS
from ..kv import TokenOutOfRange, check_max_length
from ..spec import ShardSpec
from . import batch, devices, kv_size
from .archs import recurrent_layers, rules_for
from .bindings import L
from .derive import ShardModelInfo, TokenEmbedding, model_info, shard_paths
from .errors import KVCellsFull, LlamaCppError, UnsupportedShard
from .ffi import ensure_backend, give_back_pages, graph_tap, install_tap, trim_compute_buffers
from .kv_size import KV_STREAM_ROUNDING, KVShape
from .sampling import LlamaCppSampler
from .seq import SeqKV
from .states import SeqStates

MAX_SEQUENCES = 256  # LLAMA_MAX_SEQ, src/llama-cparams.h
STEP_BUFFER_KEPT_TOKENS = 256  # a step of more rows gives its buffers' pages back after it (_give_back_step_buffers)
STATE_FORMAT = "llama.cpp-seq-state-v1"
MAX_VERIFY_TOKENS = 16  # most tokens of a speculative verify step (all rows' logits) a head takes


def kv_bytes_per_token(model: GGUFModelFile, spec: ShardSpec) -> int:
    """f16 KV bytes one token costs in llama.cpp's cache over blocks ``[spec.start, spec.end)``.

    From the GGUF header alone: ``artifact.accounting`` (per-layer KV head counts × key/value lengths,
    as ``src/llama-kv-cache.cpp`` sizes each cell; the MLA latent; 0 for recurrent layers, whose fixed
    per-session state is ``ShardAccount.state_bytes_per_session``).
    """
    return shard_account(model, spec.start, spec.end).kv_bytes_per_token


class LlamaCppShard(SeqStates):
    """Runs blocks ``[spec.start, spec.end)`` (plus embedding and/or head stage) through llama.cpp.

    ``n_ctx_seq``: KV cells of each session (its longest ``max_length``, tokens; llama.cpp rounds
    it up to a multiple of ``KV_STREAM_ROUNDING``); ``n_seq_max``: most sessions at once;
    ``n_batch``: most tokens in one step (bigger steps are refused); ``n_ubatch``: llama.cpp's
    physical batch (512 as in llama.cpp's defaults: keep equal to the reference run for bitwise
    results); ``threads``: llama.cpp decode and batch threads; ``cache_dir``: where derived shard
    GGUFs are written; ``all_logits``: the head will be asked for every position's logits
    (perplexity) — otherwise its compute buffer is sized for one output row; ``checkpoints``: exact-position
    state checkpoints kept per session on a shard llama.cpp cannot truncate partway (``exact_states_only``:
    the range holds recurrent blocks, or the architecture's cache refuses partial removal, ``deepseek4``;
    ``seq.py``), each ``state_bytes_per_session`` plus the attention KV of its tokens;
    ``kv_unified``: all sessions' cells in one KV stream (any sessions batch together, not bitwise; docs/protocol.md,
    "Throughput mode"), a session still holding at most ``n_ctx_seq`` of them; ``in_place``: load the layers from
    the model's own files (a shard header and the model files, llama.cpp patch 0004; default when the loaded
    libllama has it) or from a derived copy (``derive.shard_paths``). ``gpu`` / ``gpu_blocks``: the GPU the range's
    last blocks (as many as fit when None), their KV and the LM head run on (``devices.offload``: ``none``, ``auto``
    or a device name); ``placement``: where each block landed and llama.cpp's buffers (docs/gpu.md).

    Raises UnsupportedShard (architecture/range), LlamaCppError (llama.cpp refused the file or
    the context), ValueError (bad parameters).
    """

    backend = "llama.cpp"  # ShardBackend capabilities (runtime/backends.py); the limits are set per instance
    supports_batch = True
    step_grouping_matters = True
    state_snapshots = True
    sampler_class = LlamaCppSampler  # the head draws with llama.cpp's sampler chain
    # forward_batch: most sessions whose decode steps share one ubatch (set per instance: batch.default_batch_group;
    # docs/protocol.md, "Exactness")
    batch_group: int = batch.EXACT_BATCH_GROUP
    decode_ubatches = 0  # ubatches forward_batch's shared decodes ran (/health: sessions per ubatch)
    largest_ubatch = 0  # most sessions one of them held
    stream_copies = 0  # KV streams copied to give batched sessions consecutive ids (batch.compact)

    def __init__(
        self,
        model: GGUFModelFile,
        spec: ShardSpec,
        *,
        n_ctx_seq: int = 4096,
        n_seq_max: int = 4,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        threads: int | None = None,
        cache_dir: str | os.PathLike | None = None,
        all_logits: bool = False,
        checkpoints: int = 4,
        kv_unified: bool = False,
        in_place: bool | None = None,
        gpu: str = "none",
        gpu_blocks: int | None = None,
    ):
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
        ensure_backend()
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "ggufswarm" / "shards")
        # The whole model with its head runs from the original file and takes token ids directly.
        self.takes_tokens = spec.embed and spec.head
        self.paths = shard_paths(model, spec.start, spec.end, spec.head, cache_dir, in_place)
        self.path = self.paths[0]
        self.embedding = TokenEmbedding(model) if spec.embed and not spec.head else None
        self._lock = threading.RLock()  # reentrant: SeqKV.__del__ may run inside a step
        self._free_seqs = list(range(n_seq_max))  # a heap: the lowest free id first (keeps ids consecutive)
        self._sessions: weakref.WeakSet[SeqKV] = weakref.WeakSet()  # handed out by new_session (batch.compact)
        self._kv_bytes = kv_bytes_per_token(model, spec)
        recr = recurrent_layers(model)
        # llama.cpp cannot roll this shard's sessions back partway: recurrent blocks, or a cache that refuses it
        self.exact_states_only = (
            bool(recr and any(recr[spec.start : spec.end])) or rules_for(model.architecture).exact_states
        )
        self.checkpoints = max(0, int(checkpoints))
        rounded = -(-n_ctx_seq // KV_STREAM_ROUNDING) * KV_STREAM_ROUNDING
        per_session = rounded if kv_unified else n_ctx_seq
        # the blocks on a GPU leave room there for n_seq_max sessions' KV (allocated as sessions open, kv_size: of
        # at most GPU_SESSION_CELLS each, as `plan` counts; a longer one takes what is free then)
        fit_cells = per_session if kv_unified else min(per_session, GPU_SESSION_CELLS)
        self.device, self.gpu_blocks = devices.offload(model, spec, gpu, gpu_blocks, fit_cells, n_seq_max, n_ubatch)
        # KV in VRAM is allocated whole: a context holds only what its sessions need, grown and shrunk by copy
        self.kv_grows = bool(self.gpu_blocks) and not kv_unified
        # patch 0005's batch-invariant kernels are the CPU's: on a GPU a session's step runs alone (exact mode), and
        # no spare stream is kept for batch.compact
        self.batch_invariant = batch.enable_batch_invariance() and not kv_unified and not self.gpu_blocks
        self.spare_seq = n_seq_max if self.batch_invariant and n_seq_max < MAX_SEQUENCES else None
        n_streams = n_seq_max + (self.spare_seq is not None)
        mparams = L.llama_model_default_params()
        mparams.use_mmap = True
        self._devices = devices.set_offload(mparams, self.device, self.gpu_blocks)
        self._vocab_model = None  # vocab(): the model file's vocabulary, loaded for a grammar
        self._model, self._model_report = devices.load_model(self.paths, mparams)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {self.path} (see its error above)")
        rules = rules_for(model.architecture)
        # hidden states in and out: n_embd values per token, or hc_mult residual streams of n_embd (DeepSeek-V4), or
        # kimi-k3's residual stream with the attention-residual checkpoints banked before the cut
        self.n_embd_in, self.n_embd_out = self.cfg.width_at(spec.start), self.cfg.width_at(spec.end)
        streams = rules.streams(model.metadata, spec.start) if rules.streams else 1
        if L.llama_model_n_embd(self._model) * streams != self.n_embd_in:
            raise LlamaCppError(
                f"{self.path}: n_embd {L.llama_model_n_embd(self._model)} x {streams}, expected {self.n_embd_in}"
            )
        self.streams = streams
        # the graph reads each token's id with its hidden states (hash-routed blocks): forward(token_ids=...)
        # (talkie's skip embedding, past the first shard)
        self.needs_token_ids = (rules.token_ids or (rules.skip_embedding and spec.start > 0)) and not self.takes_tokens
        self._cparams = cparams = L.llama_context_default_params()
        cparams.n_batch = n_batch
        cparams.n_ubatch = min(n_ubatch, n_batch)
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.kv_unified = self.kv_unified = bool(kv_unified)  # False: one KV stream per session (module docstring)
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # llama.cpp's CPU default (auto -> on)
        cparams.swa_full = True  # sliding-window layers keep every position, so truncate is exact
        cparams.no_perf = True
        # outputs llama.cpp may return per ubatch (sizes the LM head's compute buffer: 512 x n_vocab floats would
        # be 512 MiB for Gemma); llama.cpp asserts it is at least n_seq_max (src/llama-context.cpp output_reserve)
        # a head also returns every row of a speculative verify step (up to MAX_VERIFY_TOKENS: 16 x n_vocab floats)
        self.max_outputs = n_batch if all_logits or not spec.head else min(max(n_streams, MAX_VERIFY_TOKENS), n_batch)
        cparams.n_outputs_max = self.max_outputs
        self._tap = None
        if not spec.head:
            self._capture = np.empty((n_batch, self.n_embd_out), dtype=np.float32)
            self._tap = graph_tap(self._capture, f"{rules.tap}-{spec.end - spec.start - 1}")
            install_tap(cparams, self._tap)
        cparams.op_offload = self.gpu_blocks > 0
        self._ctx = None
        # cells one session may hold: its stream, or with unified KV (where llama.cpp's n_ctx_seq is the whole
        # context) the same share of the one stream
        self.n_ctx_seq = rounded
        self.n_seq_max = n_seq_max
        # unified KV: each session's n_ctx_seq rounded as llama.cpp rounds a stream's (per_session); patch 0005 (CPU
        # only): sessions may share a decode ubatch, bitwise; one more stream: batch.compact's spare
        try:
            if self.kv_grows:
                self.make_context(kv_size.shape_for({}, n_seq_max, rounded, kv_size.streams_grow()))
            else:
                self.make_context(KVShape(n_streams, per_session))
        except LlamaCppError:
            L.llama_model_free(self._model)
            self._model = None
            raise
        if not self.kv_unified and not self.kv_grows:
            self.n_ctx_seq = L.llama_n_ctx_seq(self._ctx)
        self.batch_group = batch.default_batch_group(self.kv_unified, self.batch_invariant)
        if self.gpu_blocks and not self.kv_unified:  # a GPU's kernels round by batch shape: each step alone
            self.batch_group = 1
        self.n_ubatch = cparams.n_ubatch
        self.n_vocab_out = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model))
        self._batch = L.llama_batch_init(n_batch, 0 if self.takes_tokens else self.n_embd_in, 1)
        # a batch of hidden states that also carries token ids: our buffer (set to NULL again before llama_batch_free)
        self._token_ids = np.zeros(n_batch, dtype=np.int32) if self.needs_token_ids else None
        if self._token_ids is not None:
            self._batch.token = self._token_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        # where decode_steps writes each row's token id / hidden state (0: the batch has no such buffer)
        self._token_at = ctypes.cast(self._batch.token, ctypes.c_void_p).value or 0
        self._embd_at = ctypes.cast(self._batch.embd, ctypes.c_void_p).value or 0
        # M-RoPE / IMRoPE models (qwen35moe) take 4 positions per token; llama.cpp expands a token batch's one
        # position to [p, p, p, 0] itself (llm_graph_input_pos::set_input) but reads an embedding batch's four,
        # section-major (pos[j * n_tokens + i], src/llama-batch.cpp): our buffer replaces the batch's 1-wide one
        rope = L.llama_model_rope_type(self._model)
        self.n_pos_per_token = (
            4 if not self.takes_tokens and rope in (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE) else 1
        )
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

    def make_context(self, shape: KVShape) -> None:
        """Create the shard's llama.cpp context with ``shape``'s KV streams and cells (``kv_size``), and the
        placement llama.cpp reports for it. Raises LlamaCppError when llama.cpp cannot (the device's memory)."""
        self._cparams.n_ctx = shape.tokens
        self._cparams.n_seq_max = shape.streams
        with devices.buffer_report() as report:
            self._ctx = L.llama_init_from_model(self._model, self._cparams)
        if not self._ctx:
            raise LlamaCppError(
                f"llama.cpp could not create a context of {shape.streams} KV streams of {shape.cells} cells"
            )
        self.kv_shape = shape
        self._mem = L.llama_get_memory(self._ctx)
        self.placement = devices.Placement.of(
            self.device, self.gpu_blocks, self.spec, self._model_report + report, self.model
        )

    def free_context(self) -> None:
        """Free the llama.cpp context (its KV cache, compute and output buffers); ``make_context`` makes another."""
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None

    @property
    def closed(self) -> bool:
        """Whether ``close`` freed the shard."""
        return not getattr(self, "_model", None)

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
        """The model's ``llama_vocab *`` (a grammar's); a range's file has none (derive.py): loaded on first use."""
        own = L.llama_model_get_vocab(self._model)
        if L.llama_vocab_type(own) != L.LLAMA_VOCAB_TYPE_NONE:
            return own
        if self._vocab_model is None:
            params = L.llama_model_default_params()
            params.vocab_only = True
            self._vocab_model = L.llama_model_load_from_file(str(self.model.path).encode(), params)
            if not self._vocab_model:
                raise LlamaCppError(f"llama.cpp could not load the vocabulary of {self.model.path}")
        return L.llama_model_get_vocab(self._vocab_model)

    def new_session(self, max_length: int) -> SeqKV:
        """A new sequence id for a session.

        Raises ContextOverflow past the 128K cap, KVCellsFull when ``max_length`` exceeds ``n_ctx_seq``,
        all ``n_seq_max`` sequence ids are taken, or (``kv_grows``) the device cannot hold a context for it."""
        check_max_length(max_length)
        if max_length > self.n_ctx_seq:
            raise KVCellsFull(
                f"max_length {max_length} exceeds this shard's {self.n_ctx_seq} KV cells per session (node --ctx-size)",
                "kv_budget_too_small",
            )
        with self._lock:
            if not self._free_seqs:
                raise KVCellsFull(f"all {self.n_seq_max} session slots of this shard are in use")
            seq = self._free_seqs[0]
            if self.kv_grows:
                kv_size.grow(self, seq, max_length)  # KVCellsFull where the device cannot hold it
            heapq.heappop(self._free_seqs)
            kv = SeqKV(self, seq, max_length)
            self._sessions.add(kv)
        return kv

    def seq_remove(self, seq_id: int, start: int) -> None:
        """Drop sequence ``seq_id``'s cells from position ``start`` on (``llama_memory_seq_rm``); LlamaCppError when
        llama.cpp cannot cut it there (``SeqKV.truncate`` calls this)."""
        with self._lock:
            if not L.llama_memory_seq_rm(self._mem, seq_id, start, -1):
                raise LlamaCppError(f"llama.cpp cannot truncate sequence {seq_id} to {start} tokens")

    def release_seq(self, seq_id: int) -> None:
        """Free all of sequence ``seq_id``'s cells and give its id back (``SeqKV.close``; nothing after ``close``)."""
        if self.closed:  # the shard was closed (or never finished loading)
            return
        with self._lock:
            L.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            heapq.heappush(self._free_seqs, seq_id)

    def trim_compute_buffers(self) -> bool:
        """Give llama.cpp's compute buffers' memory back while idle (``ffi.trim_compute_buffers``, patch 0012), and
        the pages a long step made resident in the step buffers (the batch's hidden states, the tap's capture: each
        ``[n_batch, n_embd]`` float32, written in full before read): the next step makes resident what it writes,
        with the same results. Whether llama.cpp's ran. Waits for a step in flight."""
        kv_size.fit(self)
        with self._lock:
            self._give_back_step_buffers()
            return bool(getattr(self, "_ctx", None)) and trim_compute_buffers(self._ctx)

    def _give_back_step_buffers(self) -> None:  # (and after a long step: a prefill piece's megabytes stay otherwise)
        if self._embd_at:
            give_back_pages(self._embd_at, self.n_batch * self.n_embd_in * 4)
        if self._tap is not None:
            give_back_pages(self._capture.ctypes.data, self._capture.nbytes)

    def device_kv_tokens(self) -> int | None:
        """KV tokens this shard's GPU could hold for its sessions now (``kv_size.device_tokens``); None where its KV
        cache is not a GPU's sized to its sessions."""
        return kv_size.device_tokens(self)

    def fit_kv(self) -> bool:
        """Shrink a growing KV cache (``kv_grows``) to what the open sessions need, after some closed
        (``kv_size.fit``); whether it did. Waits for a step in flight."""
        return kv_size.fit(self)

    # -- steps ---------------------------------------------------------------------------------
    def forward(self, kv: SeqKV, inputs, logits: str = "last", token_ids=None) -> np.ndarray:
        """Run one prefill (T > 1) or decode (T = 1) step of a session.

        ``inputs`` (a numpy array, or anything ``numpy.asarray`` takes: a list, a CPU torch tensor): token ids
        ``[T]`` (int) when the shard has the embedding stage, else hidden states ``[T, n_embd_in]`` (float,
        converted to float32; ``n_embd_in`` is ``cfg.width_at(start)``, the width between shards). Returns numpy
        float32 hidden states ``[T, n_embd_out]`` (the last block's output, ``cfg.width_at(end)``), or at the head
        float32 logits ``[1, n_vocab]``
        (``logits="last"``) or ``[T, n_vocab]`` (``"all"``). ``token_ids``: int ``[T]``, the step's token ids,
        required by a shard whose graph reads them with the hidden states (``needs_token_ids``: DeepSeek-V4's
        hash-routed blocks), ignored otherwise.

        Raises ContextOverflow past ``max_length``, ValueError for wrong shapes / ids / a step over
        ``n_batch`` tokens or missing ``token_ids``, KVCellsFull when the context has no free cells, LlamaCppError
        when llama.cpp fails; on any error the session's KV cache is as before the call.
        """
        inputs = np.asarray(inputs)
        prepared = self.prepare_step(kv, inputs, token_ids)
        if self.spec.head and logits == "all" and int(inputs.shape[0]) > self.max_outputs:
            raise ValueError(
                f"this head returns at most {self.max_outputs} rows of logits per step "
                f"(load it with all_logits=True for perplexity)"
            )
        return self.decode_steps([(kv, *prepared)], logits)

    def forward_batch(self, steps: list[tuple]) -> list[np.ndarray | Exception]:
        """One step of each of several sessions, the decode steps in one ``llama_decode``: ``batch.forward_batch``
        (``(kv, inputs[, token_ids])`` per step; one result or exception per step, in order)."""
        return batch.forward_batch(self, steps)

    def prepare_step(self, kv: SeqKV, inputs: np.ndarray, token_ids=None) -> tuple:
        """Validate one step (``inputs`` a numpy array) as ``forward`` does and return what ``decode_steps`` takes
        after ``kv``: ``(ids, embd, tok)``: ids int32 ``[T]`` for a shard that takes token ids itself, else None;
        embd float32 ``[T, n_embd]`` or None; token ids int32 ``[T]`` to pass with ``embd`` (``needs_token_ids``)
        or None. Raises what ``forward`` raises for a bad step; changes nothing."""
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
                raise ValueError(
                    f"the first shard takes integer token ids [n_tokens], got {inputs.dtype} {tuple(inputs.shape)}"
                )
            ids = inputs.astype(np.int32, copy=False)
            if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.n_vocab:
                raise TokenOutOfRange(f"token id out of range [0, {self.cfg.n_vocab})")
            if self.takes_tokens:
                return ids, None, None
            embd = self.embedding(ids)
            if self.streams > 1:  # the embedding copied into every residual stream, as llama.cpp's ggml_repeat_4d
                embd = np.tile(embd, (1, self.streams))
            return None, embd, ids if self.needs_token_ids else None
        if inputs.ndim != 2 or inputs.shape[1] != self.n_embd_in:
            raise ValueError(f"expected hidden states [n_tokens, {self.n_embd_in}], got {tuple(inputs.shape)}")
        tok = None
        if self.needs_token_ids:
            if token_ids is None:
                raise ValueError(
                    f"this {self.cfg.arch} shard routes blocks by token id: a step of hidden states "
                    f"must carry its token ids"
                )
            tok = np.asarray(token_ids).astype(np.int32, copy=False).reshape(-1)
            if tok.shape[0] != n_tokens:
                raise ValueError(f"{tok.shape[0]} token ids for {n_tokens} hidden states")
            if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= self.cfg.n_vocab):
                raise TokenOutOfRange(f"token id out of range [0, {self.cfg.n_vocab})")
        return None, inputs, tok

    def decode_steps(self, steps: list[tuple], logits: str = "last") -> np.ndarray:
        """One ``llama_decode`` of prepared steps ``(kv, ids, embd, tok)`` (``prepare_step``'s parts after the
        session; different sessions, in batch order; their ``n_tokens`` rows together at most ``n_batch``).

        Returns the hidden states of all ``n_tokens`` rows ``[n_tokens, n_embd]`` float32 (a non-head shard), or at
        the head the logits of the last row ``[1, n_vocab]`` (``logits="last"``) or of every row, in batch order
        (``"all"``, ``[n_tokens, n_vocab]``) float32. Each session's ``length`` grows by its rows. Raises
        KVCellsFull when llama.cpp finds no free cells and LlamaCppError when it fails; every session's KV cache is
        then as before the call.
        """
        counts = [(ids if ids is not None else embd).shape[0] for _, ids, embd, _ in steps]
        n_tokens = sum(counts)
        all_out = not self.spec.head or logits == "all"
        with self._lock:
            batch = self._batch
            batch.n_tokens = n_tokens
            at = 0
            for (kv, ids, embd, tok), n in zip(steps, counts):
                positions = np.arange(kv.length, kv.length + n, dtype=np.int32)
                if self.n_pos_per_token == 4:  # text positions as llama.cpp writes them for tokens: [p, p, p, 0]
                    for section in range(3):  # section-major: pos[section * n_tokens + row]
                        self._pos[section * n_tokens + at : section * n_tokens + at + n] = positions
                    self._pos[3 * n_tokens + at : 3 * n_tokens + at + n] = 0
                else:
                    self._pos[at : at + n] = positions
                for i in range(at, at + n):
                    batch.seq_id[i][0] = kv.seq_id
                if ids is not None:
                    ids = np.ascontiguousarray(ids)
                    ctypes.memmove(self._token_at + at * ids.itemsize, ids.ctypes.data, ids.nbytes)
                else:
                    embd = np.ascontiguousarray(embd, dtype=np.float32)
                    ctypes.memmove(self._embd_at + at * embd[0].nbytes, embd.ctypes.data, embd.nbytes)
                    if tok is not None:
                        self._token_ids[at : at + n] = tok
                at += n
            self._out[:n_tokens] = 1 if all_out else 0
            self._out[n_tokens - 1] = 1
            if self._tap is not None:
                self._tap.reset()
            rc = L.llama_decode(self._ctx, batch)
            if rc == 1:
                raise KVCellsFull(f"no free KV cells for {n_tokens} tokens ({self.n_ctx_seq} cells per session)")
            if rc != 0:
                raise LlamaCppError(f"llama_decode of {n_tokens} tokens ({len(steps)} sessions) failed with code {rc}")
            if self._tap is not None:
                got = self._tap.rows(self.n_embd_out)
                if self._tap.overflow or got != n_tokens:
                    for kv, *_ in steps:
                        L.llama_memory_seq_rm(self._mem, kv.seq_id, kv.length, -1)
                    raise LlamaCppError(
                        f"captured {got} hidden-state rows for {n_tokens} tokens (tensor {self._tap.target.decode()})"
                    )
                out = self._capture[:n_tokens].copy()
            elif logits == "all":  # the output rows, contiguous in batch order (llama.h, llama_get_logits)
                out = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(n_tokens, self.n_vocab_out)).copy()
            else:
                out = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, -1), shape=(1, self.n_vocab_out)).copy()
            if n_tokens >= STEP_BUFFER_KEPT_TOKENS:
                self._give_back_step_buffers()
            for (kv, *_), n in zip(steps, counts):
                kv.length += n
        return out

    def close(self) -> None:
        """Free the context, batch and model (idempotent)."""
        if getattr(self, "_model", None) and hasattr(self, "_batch"):
            self._batch.pos = ctypes.cast(self._batch_pos, ctypes.POINTER(ctypes.c_int32))
            if self._token_ids is not None:
                self._batch.token = ctypes.POINTER(ctypes.c_int32)()
            L.llama_batch_free(self._batch)
            self.free_context()
            L.llama_model_free(self._model)
            self._model = None
            if self._vocab_model is not None:
                L.llama_model_free(self._vocab_model)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


__all__ = [
    "KV_STREAM_ROUNDING",
    "LlamaCppShard",
    "MAX_SEQUENCES",
    "MAX_VERIFY_TOKENS",
    "STATE_FORMAT",
    "ShardModelInfo",
    "kv_bytes_per_token",
    "model_info",
]
