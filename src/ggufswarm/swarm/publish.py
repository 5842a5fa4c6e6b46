"""Publishing a model artifact: manifest + torrent registered with the tracker, then seeded."""

from __future__ import annotations

import json
import signal
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from ..artifact.gguf_file import split_paths
from ..artifact.manifest import Manifest
from ..directory.trackers import TrackerClient
from ..net.auth import announce_key
from ..net.invite import info_hash
from .torrent import DEFAULT_PIECE_SIZE, Swarm, make_torrent, save_path_for


@dataclass
class Published:
    """What ``publish`` registered: the manifest, the torrent, its v1 info-hash."""

    manifest: Manifest
    torrent: bytes
    info_hash: str


def publish(
    model_path: Path,
    tracker: str,
    name: str | None = None,
    data_dir: Path | None = None,
    web_seeds: list[str] = (),
    piece_size: int = DEFAULT_PIECE_SIZE,
    *,
    token: str | None = None,
) -> Published:
    """Index ``model_path`` (a GGUF or any file of a split set), make its torrent (announcing to
    ``tracker``), register both with the tracker under ``name`` and write them into ``data_dir``. ``token``:
    the swarm token (sent to the tracker; the torrent announces with its ``announce_key``).

    Raises GGUFError for a bad file and TrackerError when the tracker refuses.
    """
    paths = split_paths(Path(model_path))
    manifest = Manifest.from_gguf(paths[0], name)
    announce = tracker.rstrip("/") + "/announce"
    if token:  # BitTorrent clients cannot send headers: a key derived from the token rides in the URL
        announce += "?" + urllib.parse.urlencode({"swarm_key": announce_key(token)})
    torrent = make_torrent(paths, piece_size, trackers=[announce], web_seeds=list(web_seeds))
    manifest.info_hash, manifest.piece_size, manifest.web_seeds = info_hash(torrent), piece_size, list(web_seeds)
    TrackerClient(tracker, token).put_manifest(manifest.name, json.loads(manifest.to_json()), torrent)
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / f"{manifest.name}.manifest.json").write_text(manifest.to_json())
        (data_dir / f"{manifest.name}.torrent").write_bytes(torrent)
    return Published(manifest, torrent, manifest.info_hash)


def seed_forever(
    published: Published, model_path: Path, stop: threading.Event | None = None, host: str = "127.0.0.1"
) -> None:
    """Seed the published files (listening on ``host``) until SIGINT/SIGTERM (or ``stop`` is set)."""
    stop = stop or threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    swarm = Swarm(host)
    try:
        swarm.seed(published.torrent, save_path_for(split_paths(Path(model_path))))
        while not stop.wait(1.0):
            pass
    finally:
        swarm.close()
