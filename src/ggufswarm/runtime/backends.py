"""Backend choice and contract: the ``ShardBackend`` protocol every shard backend implements, and the one place
that knows both backends (llama.cpp, torch) and builds either.

The node server, its batcher and snapshot store, ``generate`` and ``perplexity`` use only ``ShardBackend``: what a
backend can do is declared by its attributes (``supports_batch``, ``exact_states_only``, ...), never probed.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol, runtime_checkable

from ..artifact.gguf_file import GGUFModelFile
from .spec import ShardSpec

BACKENDS = ("llama.cpp", "torch")
DEFAULT_BACKEND = "llama.cpp"


@runtime_checkable
class ShardBackend(Protocol):
    """What a shard backend is: it runs blocks ``[spec.start, spec.end)`` of one GGUF model (plus the token
    embedding when ``spec.embed`` and the output head when ``spec.head``) against per-session KV caches.

    Declared capabilities (every backend sets every one; None = no limit of its own):

    * ``backend``: its name (``"llama.cpp"`` / ``"torch"``), for display and telemetry only.
    * ``n_ctx_seq``: most tokens one session holds (KV cells per session), or None.
    * ``n_batch``: most tokens of one ``forward`` call, or None.
    * ``n_ubatch``: tokens computed per graph evaluation (batching chunk), or None.
    * ``n_seq_max``: sessions held at once (llama.cpp sequence ids), or None.
    * ``max_outputs``: most positions whose logits one head step returns (speculative verify), or None.
    * ``step_lock``: the lock each step of this backend holds (a caller that takes it without blocking may run the
      step inline on its event loop), or None (steps run on a worker thread).
    * ``supports_batch``: ``forward_batch(steps)`` decodes several sessions' steps in one call; such a backend
      also counts ``decode_ubatches`` (graph evaluations those calls took), ``largest_ubatch`` (most sessions in
      one) and ``stream_copies`` (KV moved to batch sessions together), for /health.
    * ``exact_states_only``: a session truncates only to positions where an exact state was kept (recurrent
      blocks, DeepSeek-V4 compressed caches).
    * ``needs_token_ids``: ``forward`` needs the frame's token ids beside hidden states (DeepSeek-V4 hash routing).
    * ``step_grouping_matters``: numerics depend on how tokens were grouped into steps (llama.cpp), so a restored
      or replayed history must end at the step boundaries it was computed with.
    * ``state_snapshots``: a session's KV is snapshotted as one opaque sequence state (``state_bytes(kv)`` /
      ``load_state(kv, data, n_tokens)``, llama.cpp) instead of per-layer key/value tensors (``kv.layers`` /
      ``kv.load``, torch).

    A session's KV cache (``new_session``) has ``length``, ``max_length``, ``epoch``, ``closed``, ``truncate(n)``
    and ``close()``.
    """

    backend: str
    cfg: Any
    spec: ShardSpec
    model: GGUFModelFile
    n_ctx_seq: int | None
    n_batch: int | None
    n_ubatch: int | None
    n_seq_max: int | None
    max_outputs: int | None
    supports_batch: bool
    exact_states_only: bool
    needs_token_ids: bool
    step_grouping_matters: bool
    state_snapshots: bool

    @property
    def step_lock(self) -> threading.RLock | None: ...

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token costs on this shard (all its layers, keys and values)."""

    def new_session(self, max_length: int):
        """A session's KV cache (``kv.length`` tokens held, ``kv.epoch``, ``kv.truncate(n)``, ``kv.close()``).
        Raises ContextOverflow / KVCellsFull when it cannot be held."""

    def forward(self, kv, inputs, logits: str = "last", **kw):
        """Run ``inputs`` (token ids ``[n_tokens]`` int32 on an embed shard, else hidden states
        ``[n_tokens, n_embd]`` float32) through this shard's blocks appending to ``kv``: hidden states
        ``[n_tokens, n_embd]`` float32, or on a head shard logits ``[1 or n_tokens, n_vocab]`` float32."""

    def close(self) -> None:
        """Free the backend's memory (model, contexts); the object is unusable after."""


def check_backend(name: str) -> str:
    """``name`` if it is a backend; ValueError listing them otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def model_config(model: GGUFModelFile, backend: str):
    """The model-level config the backend needs (torch: ModelConfig; llama.cpp: ShardModelInfo).

    Raises UnsupportedArchitecture / UnsupportedShard (both ValueError) naming the architecture,
    with a hint to try the other backend.
    """
    if check_backend(backend) == "torch":
        from ..model import load_config

        return load_config(model)
    from .llamacpp.backend import model_info

    return model_info(model)


def load_shard(
    model: GGUFModelFile,
    spec: ShardSpec,
    backend: str = DEFAULT_BACKEND,
    *,
    config=None,
    dtype: str = "float32",
    threads: int | None = None,
    max_length: int = 4096,
    max_sessions: int = 4,
    all_logits: bool = False,
    cache_dir: str | os.PathLike | None = None,
    state_checkpoints: int = 4,
    kv_unified: bool = False,
    gpu: str = "none",
    gpu_blocks: int | None = None,
):
    """Load one shard of ``model`` on ``backend``.

    ``dtype``: torch compute dtype (``float32`` / ``bfloat16``); llama.cpp computes as llama.cpp does.
    ``threads``: llama.cpp decode/batch threads (torch threads are process-wide, set by the CLI).
    ``max_length``: longest session (llama.cpp: KV cells per session, tokens); ``max_sessions``:
    sessions at once (llama.cpp sequence ids); ``all_logits``: the head will be asked for every
    position's logits (perplexity). ``cache_dir``: where llama.cpp's derived shard GGUFs go.
    ``state_checkpoints``: llama.cpp shards that truncate only to exact states (recurrent blocks, deepseek4):
    states kept per session (``LlamaCppShard`` ``checkpoints``). ``kv_unified``: llama.cpp keeps all sessions'
    cells in one KV stream (any sessions batch together; not bitwise their runs alone). ``gpu``/``gpu_blocks``:
    llama.cpp's device for the shard's last ``gpu_blocks`` blocks (``LlamaCppShard``); the torch backend takes
    only ``none``.
    Raises ValueError (bad spec, unsupported architecture) or the backend's load errors.
    """
    if check_backend(backend) == "torch":
        import torch

        from .shard import ShardExecutor

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
        if gpu not in ("none", "auto"):
            raise ValueError(f"--gpu {gpu}: the torch backend runs on the CPU (use --backend llama.cpp for a GPU)")
        return ShardExecutor(model, spec, dtypes[dtype], config)
    from .llamacpp.backend import LlamaCppShard

    return LlamaCppShard(
        model,
        spec,
        n_ctx_seq=max_length,
        n_seq_max=max_sessions,
        threads=threads,
        all_logits=all_logits,
        cache_dir=cache_dir,
        checkpoints=state_checkpoints,
        kv_unified=kv_unified,
        gpu=gpu,
        gpu_blocks=gpu_blocks,
    )


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ShardBackend", "check_backend", "load_shard", "model_config"]
