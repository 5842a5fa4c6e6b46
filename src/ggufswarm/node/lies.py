"""Testing only: a node that lies (``ggufswarm node --test-lie KIND``), to test that clients catch one.

Kinds (``parse_lie``): ``noise`` (Gaussian noise of ``NOISE_SCALE`` × each row's RMS on the hidden states it sends
on, seeded by session and step), ``noise-every:N``, ``weights:PATH`` (another GGUF computes the shard while the node
claims the published one) and ``slow:MS`` (honest but slower, advertising a decode time of ``CLAIMED_MS``). A
liar's step commitments are honest about what it did; the noise kinds need a node that is not the head. Details:
docs/protocol.md, "Lying nodes, for tests"."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass

import numpy as np

from ..artifact.gguf_file import GGUFModelFile
from ..runtime.spec import ShardSpec

NOISE_SCALE = 0.05  # the noise's standard deviation, relative to each row's root mean square
CLAIMED_MS = 0.01  # the decode time (ms) a ``slow`` liar advertises
KINDS = "noise, noise-every:N, weights:PATH or slow:MS"


@dataclass(frozen=True)
class Lie:
    """A parsed ``--test-lie``: ``kind`` ``"noise"`` (on steps ``step % every == 0``), ``"weights"`` (from
    ``path``) or ``"slow"`` (``delay_ms`` per step, advertising ``CLAIMED_MS``)."""

    kind: str
    every: int = 1
    path: str | None = None
    delay_ms: float = 0.0  # ``slow``: added to every step

    @property
    def claimed_decode_ms(self) -> float | None:
        """The decode time (ms) this node advertises instead of its own; None: the true one."""
        return CLAIMED_MS if self.kind == "slow" else None

    def tamper(self, session_id: uuid.UUID, step: int, output):
        """The noisy version of a step's output hidden states ``[n_tokens, n_embd]`` (numpy float32, or a CPU torch
        tensor) as a new float32 numpy array; None when this lie leaves the step alone (a weights lie, or a
        step number that is not a multiple of ``every``)."""
        if self.kind != "noise" or step % self.every:
            return None
        x = output if isinstance(output, np.ndarray) else output.detach().float().numpy()
        x = np.array(x, dtype=np.float32)  # a copy: the record's array may be shared
        rng = np.random.default_rng([step, int.from_bytes(session_id.bytes, "little")])
        rms = np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=1, keepdims=True)).astype(np.float32)
        x += rng.standard_normal(x.shape, dtype=np.float32) * (np.float32(NOISE_SCALE) * rms)
        return x

    def weights(self, published: GGUFModelFile) -> GGUFModelFile:
        """The GGUF this node computes from: PATH for a weights lie (ValueError unless it has the published model's
        architecture and block count), else ``published``."""
        if self.kind != "weights":
            return published
        other = GGUFModelFile(self.path)
        arch = published.architecture
        key = f"{arch}.block_count"
        if other.architecture != arch or other.metadata.get(key) != published.metadata.get(key):
            raise ValueError(
                f"--test-lie weights:{self.path}: a {other.architecture} model with "
                f"{other.metadata.get(f'{other.architecture}.block_count')} blocks cannot pass for "
                f"{arch} with {published.metadata.get(key)}"
            )
        return other


@functools.cache
def parse_lie(text: str) -> Lie:
    """``--test-lie``'s value as a Lie (cached: steps look it up). ValueError for anything but the kinds above."""
    if text == "noise":
        return Lie("noise")
    if text.startswith("noise-every:"):
        n = text.partition(":")[2]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--test-lie noise-every:N takes a step count N >= 1, got {text!r}")
        return Lie("noise", every=int(n))
    if text.startswith("slow:"):
        try:
            ms = float(text.partition(":")[2])
            if not 0 < ms <= 60_000:
                raise ValueError
        except ValueError:
            raise ValueError(f"--test-lie slow:MS takes milliseconds in (0, 60000], got {text!r}") from None
        return Lie("slow", delay_ms=ms)
    if text.startswith("weights:") and len(text) > len("weights:"):
        return Lie("weights", path=text.partition(":")[2])
    raise ValueError(f"--test-lie must be {KINDS}, got {text!r}")


def check_lie(lie: Lie, spec: ShardSpec) -> None:
    """ValueError when ``lie`` cannot be told on ``spec``: noise needs a node with a next hop (not the head)."""
    if lie.kind == "noise" and spec.head:
        raise ValueError(
            "--test-lie noise perturbs the hidden states a node sends on: give it to a node that is not the "
            "head (--head samples tokens and sends no hidden states)"
        )


__all__ = ["CLAIMED_MS", "KINDS", "NOISE_SCALE", "Lie", "check_lie", "parse_lie"]
