"""Backend choice: the one place that knows both shard backends (llama.cpp, torch) and builds either.

A backend executes one shard (``runtime.spec.ShardSpec``) with the same interface:
``new_session(max_length) -> kv`` (``kv.length``, ``kv.epoch``, ``kv.truncate(n)``),
``forward(kv, inputs, logits) -> hidden [T, n_embd] | logits [1 or T, n_vocab]``,
``kv_bytes_per_token()``, ``cfg`` (``n_layers``, ``n_embd``, ``n_vocab``, ``max_length``, ``arch``),
``spec``, ``model`` and ``backend`` (its name). The node server, ``generate`` and ``perplexity``
use only that interface.
"""

from __future__ import annotations

import os

from ..artifact.gguf_file import GGUFModelFile
from .spec import ShardSpec

BACKENDS = ("llama.cpp", "torch")
DEFAULT_BACKEND = "llama.cpp"


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


def load_shard(model: GGUFModelFile, spec: ShardSpec, backend: str = DEFAULT_BACKEND, *, config=None,
               dtype: str = "float32", threads: int | None = None, max_length: int = 4096, max_sessions: int = 4,
               all_logits: bool = False, cache_dir: str | os.PathLike | None = None, state_checkpoints: int = 4,
               kv_unified: bool = False):
    """Load one shard of ``model`` on ``backend``.

    ``dtype``: torch compute dtype (``float32`` / ``bfloat16``); llama.cpp computes as llama.cpp does.
    ``threads``: llama.cpp decode/batch threads (torch threads are process-wide, set by the CLI).
    ``max_length``: longest session (llama.cpp: KV cells per session, tokens); ``max_sessions``:
    sessions at once (llama.cpp sequence ids); ``all_logits``: the head will be asked for every
    position's logits (perplexity). ``cache_dir``: where llama.cpp's derived shard GGUFs go.
    ``state_checkpoints``: llama.cpp shards that truncate only to exact states (recurrent blocks, deepseek4):
    states kept per session (``LlamaCppShard`` ``checkpoints``). ``kv_unified``: llama.cpp keeps all sessions'
    cells in one KV stream (any sessions batch together; not bitwise their runs alone).
    Raises ValueError (bad spec, unsupported architecture) or the backend's load errors.
    """
    if check_backend(backend) == "torch":
        import torch

        from .shard import ShardExecutor
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
        return ShardExecutor(model, spec, dtypes[dtype], config)
    from .llamacpp.backend import LlamaCppShard
    return LlamaCppShard(model, spec, n_ctx_seq=max_length, n_seq_max=max_sessions, threads=threads,
                         all_logits=all_logits, cache_dir=cache_dir, checkpoints=state_checkpoints,
                         kv_unified=kv_unified)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "check_backend", "load_shard", "model_config"]
