"""The torch backend's per-session KV cache of one shard: growable per-layer key/value buffers written by position."""

from __future__ import annotations

import torch

from .kv import ContextOverflow, KVPosition, check_max_length


class LayerKV:
    """Keys and values of one layer for one session: keys ``[capacity, n_head_kv, head_dim]``, values
    ``[capacity, n_head_kv, v_dim]`` (``v_dim`` = ``head_dim`` unless given; 0 for a cache that keeps
    only keys, as MLA's latent).

    Capacity doubles as tokens arrive (never past ``max_length``), so a 128K-token session only
    holds memory for the tokens it has.
    """

    __slots__ = ("k", "v", "length", "max_length")

    def __init__(self, n_head_kv: int, head_dim: int, max_length: int, dtype: torch.dtype, v_dim: int | None = None):
        cap = min(max_length, 256)
        self.k = torch.empty(cap, n_head_kv, head_dim, dtype=dtype)
        self.v = torch.empty(cap, n_head_kv, head_dim if v_dim is None else v_dim, dtype=dtype)
        self.length = 0
        self.max_length = max_length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write ``k`` ``[T, n_head_kv, head_dim]`` / ``v`` ``[T, n_head_kv, v_dim]`` at positions
        ``length..length+T-1``.

        Returns views of all keys, all values (``[length+T, n_head_kv, head_dim / v_dim]``) and their
        positions ``[length+T]`` (int64).
        """
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:
            cap = min(self.max_length, max(end, 2 * self.k.shape[0]))
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(cap, *old.shape[1:], dtype=old.dtype)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.k[self.length : end] = k
        self.v[self.length : end] = v
        self.length = end
        return self.k[:end], self.v[:end], torch.arange(end)

    def nbytes(self) -> int:
        """Bytes allocated for this layer's buffers."""
        return self.k.nbytes + self.v.nbytes


class SessionKV(KVPosition):
    """One session's KV cache on one shard: a LayerKV per layer of the shard, and the position.

    ``length`` is the number of tokens held (= position of the next token); ``closed`` once ``close`` was called.
    """

    def __init__(
        self,
        n_layers: int,
        n_head_kv: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        v_dim: int | None = None,
    ):
        self.max_length = check_max_length(max_length)
        self.layers = [LayerKV(n_head_kv, head_dim, max_length, dtype, v_dim) for _ in range(n_layers)]
        self.length = 0
        self.epoch = 0  # bumped by every truncate/load: positions below ``length`` may have been rewritten
        self.closed = False

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` tokens (drop positions ``>= length``); ValueError past the end."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length}: session holds {self.length} tokens")
        self.length = length
        self.epoch += 1
        for layer in self.layers:
            layer.length = length

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Replace the whole cache with ``keys[i]`` ``[n, n_head_kv, head_dim]`` / ``values[i]``
        ``[n, n_head_kv, v_dim]`` per layer (a restored snapshot; converted to this cache's dtype).
        ValueError for a wrong layer count or shape, ContextOverflow past ``max_length``; the cache is
        unchanged then."""
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"snapshot has {len(keys)} layers, this shard {len(self.layers)}")
        n = keys[0].shape[0] if keys else 0
        want = tuple(self.layers[0].k.shape[1:]) if self.layers else ()
        want_v = tuple(self.layers[0].v.shape[1:]) if self.layers else ()
        for k, v in zip(keys, values):
            if k.shape[0] != n or tuple(k.shape[1:]) != want or tuple(v.shape) != (n, *want_v):
                raise ValueError(
                    f"snapshot K/V shapes {tuple(k.shape)} / {tuple(v.shape)} do not fit [n, {want}] / [n, {want_v}]"
                )
        if n > self.max_length:
            raise ContextOverflow(f"snapshot holds {n} tokens; the session's max_length is {self.max_length}")
        self.truncate(0)
        for layer, k, v in zip(self.layers, keys, values):
            layer.append(k.to(layer.k.dtype), v.to(layer.v.dtype))
        self.length = n

    def nbytes(self) -> int:
        """Bytes allocated for all layers of this session."""
        return sum(layer.nbytes() for layer in self.layers)

    def close(self) -> None:
        """Mark the session closed (idempotent); its buffers are freed when it is garbage-collected (snapshots in
        flight may still hold views of them)."""
        self.closed = True
