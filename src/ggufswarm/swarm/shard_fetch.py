"""A node's side of the swarm: choose a layer range, fetch just its bytes, keep seeding them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..artifact.manifest import Manifest
from ..runtime.shard import ShardSpec
from ..tracker.routing import Advertisement
from .publish import tracker_call
from .torrent import FetchStats, Swarm


def choose_layers(manifest: Manifest, ads: list[Advertisement], budget_bytes: int) -> ShardSpec:
    """The layer range the swarm covers least (fewest advertisements per layer, summed), as wide as
    ``budget_bytes`` of block weights allows (at least one layer); embed/head when it touches the ends."""
    n = manifest.n_layers
    per_layer = manifest.layer_bytes()
    cover = [0] * n
    for ad in ads:
        for i in range(max(0, ad.layers[0]), min(n, ad.layers[1])):
            cover[i] += 1
    width, total = 0, 0
    while width < n and total + per_layer[width] <= budget_bytes:
        total += per_layer[width]
        width += 1
    width = max(width, 1)
    best = min(range(n - width + 1), key=lambda s: (sum(cover[s:s + width]), s))
    return ShardSpec(best, best + width, embed=best == 0, head=best + width == n)


@dataclass
class FetchedShard:
    """A shard's bytes on local disk: the (sparse) GGUF path, its spec, the swarm seeding it."""

    path: Path
    spec: ShardSpec
    manifest: Manifest
    swarm: Swarm
    torrent: bytes
    stats: FetchStats


def fetch_shard(tracker: str, name: str, layers: str, embed: bool, head: bool, data_dir: Path,
                budget_bytes: int = 8 << 30, progress: bool = True, timeout: float = 1800.0,
                stall_s: float = 60.0, *, token: str | None = None) -> FetchedShard:
    """Fetch from the swarm only the pieces a shard needs (header + its tensors), verified, into
    ``data_dir``; returns with the swarm still seeding them. ``layers``: ``"START:END"`` or ``"auto"``.
    ``timeout``: seconds in all; ``stall_s``: seconds without a new piece before it warns and retries
    (``Swarm.fetch``). ``token``: the swarm token, for the tracker.

    Raises TrackerError (unknown model, tracker down), ValueError (bad range), SwarmError (fetch failed).
    """
    base = tracker.rstrip("/")
    found = tracker_call(f"{base}/manifests/{name}", token=token)
    manifest = Manifest.from_json(json.dumps(found["manifest"]))
    torrent = bytes.fromhex(found["torrent_hex"])
    if layers == "auto":
        ads = [Advertisement(a["node_id"], a["url"], a["model"], tuple(a["layers"]), a["embed"], a["head"], a["state"])
               for a in tracker_call(f"{base}/nodes?model={name}", token=token)["nodes"]]
        spec = choose_layers(manifest, ads, budget_bytes)
    else:
        spec = ShardSpec.parse(layers, manifest.n_layers, embed, head)
    data_dir.mkdir(parents=True, exist_ok=True)
    swarm = Swarm()
    ranges = manifest.byte_ranges(spec.start, spec.end, spec.embed, spec.head)
    stats = swarm.fetch(torrent, data_dir, ranges, timeout=timeout, progress=progress, stall_s=stall_s)
    first = manifest.files[0]["name"]
    path = data_dir / first if len(manifest.files) == 1 else next(data_dir.glob(f"*/{first}"))
    return FetchedShard(path, spec, manifest, swarm, torrent, stats)


def fetch_header(tracker: str, name: str, data_dir: Path, progress: bool = False, *,
                 token: str | None = None) -> tuple[Path, Swarm]:
    """Fetch only the GGUF header(s) of ``name`` (metadata + vocabulary, no tensors) for a tokenizer
    (``token``: the swarm token, for the tracker).

    Returns the sparse file's path and the swarm (seeding what it holds; close it when done).
    """
    found = tracker_call(f"{tracker.rstrip('/')}/manifests/{name}", token=token)
    manifest = Manifest.from_json(json.dumps(found["manifest"]))
    torrent = bytes.fromhex(found["torrent_hex"])
    data_dir.mkdir(parents=True, exist_ok=True)
    swarm = Swarm()
    swarm.fetch(torrent, data_dir, manifest.byte_ranges(0, 0), progress=progress)
    first = manifest.files[0]["name"]
    path = data_dir / first if len(manifest.files) == 1 else next(data_dir.glob(f"*/{first}"))
    return path, swarm
