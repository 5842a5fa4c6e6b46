"""Shard specs: which layer range of a model a shard runs, and whether it has the embedding and head stages."""

from __future__ import annotations

import re
from dataclasses import dataclass

_RANGE_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class ShardSpec:
    """A contiguous layer range ``[start, end)``, plus the embedding stage and/or the head stage."""

    start: int
    end: int
    embed: bool = False
    head: bool = False

    @classmethod
    def parse(cls, text: str, n_layers: int, embed: bool = False, head: bool = False) -> ShardSpec:
        """Parse ``"START:END"`` (half-open, as Python slices); ValueError when malformed or out of range."""
        m = _RANGE_RE.match(text)
        if not m:
            raise ValueError(f"layer range must look like START:END, got {text!r}")
        spec = cls(int(m[1]), int(m[2]), embed, head)
        spec.validate(n_layers)
        return spec

    def validate(self, n_layers: int) -> None:
        """ValueError unless ``0 <= start <= end <= n_layers``, the shard does something, a head ends at ``n_layers``
        and an embedding stage starts at 0."""
        if self.start > self.end:
            raise ValueError(f"layer range {self.start}:{self.end} is reversed (START must be <= END)")
        if not 0 <= self.start <= self.end <= n_layers:
            raise ValueError(f"layer range {self.start}:{self.end} is outside the model's 0:{n_layers}")
        if self.start == self.end and not (self.embed or self.head):
            raise ValueError(f"layer range {self.start}:{self.end} is empty")
        if self.head and self.end != n_layers:
            raise ValueError(
                f"--head runs the output norm and LM head after the model's last layer: layers {self.start}:{self.end} "
                f"do not end at {n_layers}, the model's layer count (e.g. {self.start}:{n_layers} --head)"
            )
        if self.embed and self.start != 0:
            raise ValueError(
                f"--embed runs the token embedding before layer 0: layers {self.start}:{self.end} do not start there "
                f"(e.g. 0:{self.end} --embed)"
            )

    @property
    def layers(self) -> range:
        """The block indices this shard runs."""
        return range(self.start, self.end)


def even_split(n_layers: int, n_shards: int) -> list[ShardSpec]:
    """Split ``[0, n_layers)`` into ``n_shards`` contiguous near-equal ranges; embed first, head last."""
    if not 1 <= n_shards <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_shards} shards")
    bounds = [round(i * n_layers / n_shards) for i in range(n_shards + 1)]
    return [ShardSpec(bounds[i], bounds[i + 1], embed=i == 0, head=i == n_shards - 1) for i in range(n_shards)]


def split_at(n_layers: int, points: list[int]) -> list[ShardSpec]:
    """Shards cut at ``points`` (e.g. ``[6, 12]`` → ``[0,6) [6,12) [12,n)``); ValueError unless increasing and
    inside."""
    bounds = [0, *points, n_layers]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"split points {points} must be strictly increasing inside 1..{n_layers - 1}")
    return [
        ShardSpec(a, b, embed=i == 0, head=i == len(bounds) - 2) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


__all__ = ["ShardSpec", "even_split", "split_at"]
