"""A node's side of the swarm: choose a layer range, fetch just its bytes, keep seeding them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..artifact import cut_rules
from ..artifact.gguf_file import GGUFModelFile
from ..artifact.manifest import Manifest
from ..directory.routing import Advertisement
from ..directory.trackers import TrackerClient
from ..net.addresses import is_loopback
from ..runtime.spec import ShardSpec
from .torrent import FetchStats, Swarm, pieces_for_ranges

# (GGUF metadata, start, end, head) → why a node refuses blocks [start, end), or None
RangeCheck = Callable[[dict, int, int, bool], "str | None"]


def shard_bytes(manifest: Manifest, start: int, end: int) -> int:
    """Encoded tensor bytes a node serving blocks ``[start, end)`` holds: its blocks, plus the token embedding when
    it starts at block 0 and the output norm and LM head (or the tied embedding) when it ends at the last block."""
    per_layer = manifest.layer_bytes()
    sizes = {t.name: t.n_bytes for t in manifest.tensors}
    stages = set()
    if start == 0:
        stages.add("token_embd.weight")
    if end == manifest.n_layers:
        stages |= {"output_norm.weight", "output.weight" if "output.weight" in sizes else "token_embd.weight"}
    return sum(per_layer[start:end]) + sum(sizes.get(name, 0) for name in stages)


def choose_layers(
    manifest: Manifest,
    ads: list[Advertisement],
    budget_bytes: int,
    cuttable: Callable[[int, int], bool] | None = None,
) -> ShardSpec:
    """The layer range a new node (``--layers auto``) serves, within ``budget_bytes`` of tensors (``shard_bytes``:
    blocks, embedding, head); embed/head when it touches the ends. ``cuttable(start, end)``: whether the node could
    run that range (the model's cut rules, ``artifact/cut_rules.py``); ranges it refuses are never chosen while
    another fits.

    A range whose ends are boundaries the swarm already has (0, the last block, or an end of an advertised range)
    can replace the nodes there or chain with them: among those that fit, the least covered (advertisements per
    layer, mean), then the widest, then the lowest. When none fits, the least covered window as wide as the budget
    allows (at least one block).
    """
    if cuttable is not None:
        spec = _choose(manifest, ads, budget_bytes, cuttable)
        if spec is not None:
            return spec  # (else nothing the rules allow fits: the node's start-up check says why)
    return _choose(manifest, ads, budget_bytes, None)


def _choose(
    manifest: Manifest, ads: list[Advertisement], budget_bytes: int, cuttable: Callable[[int, int], bool] | None
) -> ShardSpec | None:
    """choose_layers among the ranges ``cuttable`` allows (None: any); None when none fits."""
    n = manifest.n_layers
    ok = cuttable or (lambda s, e: True)
    cover = [0] * n
    cuts = {0, n}
    for ad in ads:
        lo, hi = max(0, ad.layers[0]), min(n, ad.layers[1])
        cuts |= {lo, hi}
        for i in range(lo, hi):
            cover[i] += 1
    cuts = sorted(c for c in cuts if 0 <= c <= n)
    aligned = [(s, e) for s in cuts for e in cuts if s < e and shard_bytes(manifest, s, e) <= budget_bytes and ok(s, e)]
    if aligned:
        s, e = min(aligned, key=lambda r: (sum(cover[r[0] : r[1]]) / (r[1] - r[0]), r[0] - r[1], r[0]))
        return ShardSpec(s, e, embed=s == 0, head=e == n)
    for width in range(n, 0, -1):
        fits = [s for s in range(n - width + 1) if shard_bytes(manifest, s, s + width) <= budget_bytes]
        fits = [s for s in fits if ok(s, s + width)]
        if fits or (width == 1 and cuttable is None):
            best = min(fits or range(n), key=lambda s: (sum(cover[s : s + width]), s))
            return ShardSpec(best, best + width, embed=best == 0, head=best + width == n)
    return None


@dataclass
class FetchedShard:
    """A shard's bytes on local disk: the (sparse) GGUF path, its spec, the swarm seeding it."""

    path: Path
    spec: ShardSpec
    manifest: Manifest
    swarm: Swarm
    torrent: bytes
    stats: FetchStats
    answer: dict | None = None  # {"manifest", "torrent_hex"} as the tracker or peer gave it (its digest: the model id)


def fetch_shard(
    tracker: str | None,
    name: str,
    layers: str,
    embed: bool,
    head: bool,
    data_dir: Path,
    budget_bytes: int = 8 << 30,
    progress: bool = True,
    timeout: float = 1800.0,
    stall_s: float = 60.0,
    *,
    token: str | None = None,
    directory=None,
    swarm: Swarm | None = None,
    stages_follow: bool = False,
    range_check: RangeCheck | None = cut_rules.range_problem,
) -> FetchedShard:
    """Fetch from the swarm only the pieces a shard needs (header + its tensors), verified, into
    ``data_dir``; returns with the swarm still seeding them. ``layers``: ``"START:END"`` or ``"auto"``.
    ``timeout``: seconds in all; ``stall_s``: seconds without a new piece before it warns and retries
    (``Swarm.fetch``). ``token``: the swarm token, for the tracker.

    ``directory`` (a ``directory.lookup.Directory``: trackers and the DHT) replaces ``tracker``: the manifest then
    comes from a tracker or, when none answers, from a node the DHT lists (checked against the model's identity),
    and the torrent's peers from the DHT and the nodes' advertisements. ``swarm``: the libtorrent session to fetch
    in (a node's, with its DHT and port mapping); a new loopback one by default. ``stages_follow``: a ``START:END``
    range that starts at 0 / ends at the last layer gets the embedding / head stage (as ``"auto"`` always does).
    ``range_check``: ``"auto"`` fetches the header first and picks only a range this checks accepts: ``(metadata,
    start, end, head)`` → why the node refuses it, or None (a llama.cpp node: ``llamacpp.derive.node_range_problem``,
    its start-up check; default: the cut rules ``plan`` places by; None: another backend's node, no rule).

    Raises TrackerError (unknown model, tracker down), DirectoryError (no source answered), ValueError (bad range),
    SwarmError (fetch failed).
    """
    peers: list[tuple[str, int]] = []
    if directory is None:
        client = TrackerClient(tracker, token)
        found = client.manifest(name)
        listed = client.nodes(name) if layers == "auto" else []
    else:
        found, listed = _ask(directory)
        peers = torrent_peers(listed)
    manifest = Manifest.from_json(json.dumps(found["manifest"]))
    torrent = bytes.fromhex(found["torrent_hex"])
    data_dir.mkdir(parents=True, exist_ok=True)
    swarm = swarm or Swarm()
    if layers == "auto":
        ads = [
            Advertisement(a["node_id"], a["url"], a["model"], tuple(a["layers"]), a["embed"], a["head"], a["state"])
            for a in listed
        ]
        cuttable = None
        if range_check:  # the header first (kilobytes to a few MiB): a range the node would refuse is never chosen
            swarm.fetch(torrent, data_dir, manifest.byte_ranges(0, 0), peers, timeout=timeout, progress=False)
            cuttable = _cuttable(_first_file(manifest, data_dir), manifest.n_layers, range_check)
        spec = choose_layers(manifest, ads, budget_bytes, cuttable)
    else:
        spec = ShardSpec.parse(layers, manifest.n_layers, embed, head)
        if stages_follow:  # a joining node: the embedding / head stage come with a range at the model's ends
            spec = ShardSpec(spec.start, spec.end, embed or spec.start == 0, head or spec.end == manifest.n_layers)
    ranges = manifest.byte_ranges(spec.start, spec.end, spec.embed, spec.head)

    def listed() -> tuple[list[dict], list[dict]]:
        if directory is None:
            client = TrackerClient(tracker, token, timeout_s=5.0)
            return client.nodes(name), client.peers(name)
        return _ask(directory)[1], []

    describe = stall_reason(manifest, torrent, spec, listed)
    if progress:  # (the bar shows only on a terminal: a line that says what is coming, wherever stderr goes)
        wanted = sum(end - begin for _, begin, end in ranges)
        print(
            f"fetching layers {spec.start}:{spec.end} of {name} from the swarm ({wanted / 2**20:.1f} MiB)",
            file=sys.stderr,
            flush=True,
        )
    stats = swarm.fetch(
        torrent, data_dir, ranges, peers, timeout=timeout, progress=progress, stall_s=stall_s, on_stall=describe
    )
    return FetchedShard(_first_file(manifest, data_dir), spec, manifest, swarm, torrent, stats, found)


def _first_file(manifest: Manifest, data_dir: Path) -> Path:
    """Where the swarm saves the model's first file (its only one, or the first of a split set) under ``data_dir``."""
    first = manifest.files[0]["name"]
    return data_dir / first if len(manifest.files) == 1 else next(data_dir.glob(f"*/{first}"))


def _cuttable(
    path: Path, n_layers: int, range_check: RangeCheck = cut_rules.range_problem
) -> Callable[[int, int], bool] | None:
    """Whether a node runs blocks ``[start, end)`` of the GGUF at ``path`` (its header fetched), by ``range_check``
    (default: the cut rules ``plan`` places by); None for an architecture llama.cpp nodes do not run (no rule to pick
    by)."""
    metadata = GGUFModelFile(path, header_only=True).metadata
    if cut_rules.Header(metadata).rules is None:
        return None
    return lambda start, end: range_check(metadata, start, end, end == n_layers) is None


def _spans(blocks: list[int]) -> str:
    """Sorted block indices as half-open ranges: ``[6, 7, 8, 11]`` → ``"6:9, 11:12"``."""
    out, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            out.append(f"{start}:{b + 1}")
            start = None
    return ", ".join(out)


def stall_reason(
    manifest: Manifest, torrent: bytes, spec: ShardSpec, listed: Callable[[], tuple[list[dict], list[dict]]]
) -> Callable[[list[int]], str]:
    """``Swarm.fetch``'s ``on_stall`` for a shard: given the missing pieces no connected peer holds, a sentence
    naming the layers they belong to and who should hold them — ``listed()`` returns ``(advertisements, peers)``
    as a tracker lists them (``GET /nodes``, ``GET /peers``; the DHT lists nodes only) — marking each address that
    is loopback-only (a publisher or node there listens where no other machine can reach it)."""
    by_block: dict[int, set[int]] = {}

    def pieces_of(block: int) -> set[int]:
        if block not in by_block:
            tensors = [t for t in manifest.tensors if t.layer == block]
            by_block[block] = pieces_for_ranges(torrent, [(t.file, t.offset, t.offset + t.n_bytes) for t in tensors])
        return by_block[block]

    def describe(missing: list[int]) -> str:
        if not missing:
            return "The peers connected hold every missing piece but sent none."
        gone = set(missing)
        blocks = [b for b in range(spec.start, spec.end) if pieces_of(b) & gone]
        what = f"layers {_spans(blocks)}" if blocks else "the embedding, output head or header"
        try:
            ads, peers = listed()
        except (RuntimeError, OSError) as exc:  # TrackerError, DirectoryError
            return f"No peer it reached holds {what}; who does could not be asked ({exc})."
        lo, hi = (blocks[0], blocks[-1] + 1) if blocks else (spec.start, spec.end)
        holders = []
        for ad in ads:
            a, b = ad.get("layers", (0, 0))
            if a < hi and b > lo:
                torrent_at = ((ad.get("extra") or {}).get("reach") or {}).get("torrent")
                where = f"torrent {torrent_at}" if torrent_at else "no torrent address advertised"
                flag = "; loopback-only" if is_loopback(urlsplit(str(ad.get("url"))).hostname) else ""
                holders.append(f"node {ad.get('url')} (layers {a}:{b}, {ad.get('state')}, {where}{flag})")
        for peer in peers:
            if peer.get("left") == 0:
                flag = " (loopback-only)" if is_loopback(str(peer.get("ip"))) else ""
                holders.append(f"seed {peer.get('ip')}:{peer.get('port')}{flag}")
        if not holders:
            return f"No reachable peer holds {what}, and none is listed as holding them: is a node or publisher up?"
        hint = ""
        if any("loopback-only" in h for h in holders):
            hint = (
                " A publisher or node listening on loopback cannot be reached from another machine: restart it "
                "without --host 127.0.0.1, or with --host ADDR."
            )
        return f"No peer it reached holds {what}; listed as holding them: {'; '.join(holders)}.{hint}"

    return describe


def torrent_peers(ads: list[dict]) -> list[tuple[str, int]]:
    """The BitTorrent endpoints ``(host, port)`` nodes advertise (``extra.reach.torrent``, ``"host:port"``)."""
    out = []
    for ad in ads:
        where = ((ad.get("extra") or {}).get("reach") or {}).get("torrent")
        if isinstance(where, str) and ":" in where:
            host, _, port = where.rpartition(":")
            if port.isdigit():
                out.append((host, int(port)))
    return out


def _ask(directory) -> tuple[dict, list[dict]]:
    """The manifest answer and the node list of ``directory``, asked on the shared client loop (blocking)."""
    import aiohttp

    from ..client import loop
    from ..directory.lookup import DirectoryError

    async def both():
        async with aiohttp.ClientSession() as http:
            found = await directory.manifest(http)
            try:
                listed = await directory.nodes(http)
            except DirectoryError:  # no node listed yet: the torrent's own peers (DHT) may still have the pieces
                listed = []
            return found, listed

    return loop.run(both())


def fetch_header(
    tracker: str | None,
    name: str,
    data_dir: Path,
    progress: bool = False,
    *,
    token: str | None = None,
    directory=None,
    swarm: Swarm | None = None,
) -> tuple[Path, Swarm]:
    """Fetch only the GGUF header(s) of ``name`` (metadata + vocabulary, no tensors) for a tokenizer
    (``token``: the swarm token, for the tracker).

    ``directory`` and ``swarm``: as ``fetch_shard`` (the manifest from a tracker or a DHT-listed node, checked
    against the join link; the pieces from the torrent's peers, verified by BitTorrent).

    Returns the sparse file's path and the swarm (seeding what it holds; close it when done).
    """
    if directory is None:
        found, peers = TrackerClient(tracker, token).manifest(name), []
    else:
        found, listed = _ask(directory)
        peers = torrent_peers(listed)
    manifest = Manifest.from_json(json.dumps(found["manifest"]))
    torrent = bytes.fromhex(found["torrent_hex"])
    data_dir.mkdir(parents=True, exist_ok=True)
    swarm = swarm or Swarm()
    swarm.fetch(torrent, data_dir, manifest.byte_ranges(0, 0), peers, progress=progress)
    first = manifest.files[0]["name"]
    path = data_dir / first if len(manifest.files) == 1 else next(data_dir.glob(f"*/{first}"))
    return path, swarm
