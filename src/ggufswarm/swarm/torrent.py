"""BitTorrent swarm for model artifacts (libtorrent): make a torrent, seed it, fetch only some byte ranges.

Torrents are hybrid v1+v2, so every piece is verified with SHA-256 (BitTorrent v2 merkle trees)
as well as SHA-1. Peers find each other through the tracker's announce endpoint; DHT, LSD, UPnP
and NAT-PMP are off, so a swarm stays inside the network its tracker sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import libtorrent as lt

from ..net.invite import info_hash

log = logging.getLogger(__name__)

RECENT_PIECE_S = 2.0  # pieces held for less than this when a fetch completes are checked on disk (_wait_written)
WRITE_WAIT_S = 10.0  # how long a completed fetch waits for those pieces' bytes to reach the files (s)
NO_PEER_RETRY_S = 5.0  # a fetch with no peer connected asks for peers again this often (s)
DEFAULT_PIECE_SIZE = 256 * 1024  # small pieces keep a partial fetch tight (≤ 1 piece of waste per range edge)


class SwarmError(RuntimeError):
    """A fetch could not complete (timeout, no peers, storage error)."""


def make_torrent(
    paths: list[Path], piece_size: int = DEFAULT_PIECE_SIZE, trackers: list[str] = (), web_seeds: list[str] = ()
) -> bytes:
    """Bencoded hybrid torrent over the files of one artifact (a GGUF or a split set in one directory).

    A single file is stored as itself; several files under their directory's name. Hashes the
    files (reads them once). Raises ValueError for a piece size that is not a power of two ≥ 16 KiB.
    """
    if piece_size < 16384 or piece_size & (piece_size - 1):
        raise ValueError(f"piece size must be a power of two >= 16384 bytes, got {piece_size}")
    paths = [Path(p) for p in paths]
    if len(paths) == 1:
        entries, root = [lt.create_file_entry(paths[0].name, paths[0].stat().st_size)], paths[0].parent
    else:
        parent = paths[0].parent
        entries = [lt.create_file_entry(f"{parent.name}/{p.name}", p.stat().st_size) for p in paths]
        root = parent.parent
    ct = lt.create_torrent(entries, piece_size)
    for tier, url in enumerate(trackers):
        ct.add_tracker(url, tier)
    for url in web_seeds:
        ct.add_url_seed(url)
    ct.set_creator("ggufswarm")
    lt.set_piece_hashes(ct, str(root))
    return lt.bencode(ct.generate())


def save_path_for(paths: list[Path]) -> Path:
    """The libtorrent ``save_path`` under which ``paths`` are laid out as make_torrent names them."""
    return paths[0].parent if len(paths) == 1 else paths[0].parent.parent


def pieces_for_ranges(torrent: bytes, ranges: list[tuple[int, int, int]]) -> set[int]:
    """Piece indices that overlap byte ranges ``(file index, begin, end)`` of the artifact's files
    (index in artifact order, pad files not counted)."""
    ti = lt.torrent_info(lt.bdecode(torrent))
    fs = ti.layout()
    # hybrid torrents interleave pad files; the artifact's file i is the i-th real file
    real = [i for i in range(fs.num_files()) if not fs.file_flags(i) & lt.file_storage.flag_pad_file]
    pieces: set[int] = set()
    for file_index, begin, end in ranges:
        if end <= begin:
            continue
        first = ti.map_file(real[file_index], begin, 1).piece
        last = ti.map_file(real[file_index], end - 1, 1).piece
        pieces.update(range(first, last + 1))
    return pieces


def _wait_written(ti: lt.torrent_info, save_path: Path, pieces: list[int], timeout: float) -> None:
    """Wait until each of ``pieces`` is in the files under ``save_path`` (its bytes match its SHA-1): libtorrent
    reports a piece held once its hash checks, which may be computed from its write buffer before the bytes reach the
    file (a reader right after the fetch saw zeros). Raises SwarmError when one is not there within ``timeout`` s."""
    import hashlib

    if not ti.info_hashes().has_v1():  # (ggufswarm's torrents are hybrid: make_torrent)
        return
    files = ti.layout()
    deadline = time.monotonic() + timeout
    for piece in pieces:
        while True:
            digest = hashlib.sha1()
            for part in ti.map_block(piece, 0, ti.piece_size(piece)):
                if files.file_flags(part.file_index) & lt.file_storage.flag_pad_file:
                    digest.update(bytes(part.size))
                    continue
                with open(save_path / files.file_path(part.file_index), "rb") as f:
                    f.seek(part.offset)
                    digest.update(f.read(part.size))
            if digest.digest() == ti.hash_for_piece(piece):
                break
            if time.monotonic() > deadline:
                raise SwarmError(f"piece {piece} is held but its bytes did not reach {save_path} in {timeout:.0f} s")
            time.sleep(0.02)


@dataclass
class FetchStats:
    """Outcome of a partial fetch: pieces and payload bytes downloaded, seconds taken."""

    pieces: int
    bytes_downloaded: int
    seconds: float


class Swarm:
    """One libtorrent session bound to ``host`` (loopback by default) on an OS-chosen or given port (TCP for peers,
    UDP for the DHT).

    ``dht_bootstrap``: ``["host:port", ...]`` turns the BitTorrent DHT on, bootstrapped from those contacts only
    (never a public router; ``net.dht.dht_settings``): peers of a torrent are then found without a tracker, and the
    session can announce and look up nodes (``net.dht.Discovery``). UPnP and NAT-PMP stay off until a node asks its
    home router for a mapping (``net.portmap``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, dht_bootstrap: list[str] | None = None):
        settings = {
            "listen_interfaces": f"{host}:{port}",
            "enable_dht": False,
            "dht_bootstrap_nodes": "",  # never libtorrent's built-in public router
            "enable_lsd": False,  # local service discovery multicasts outside the swarm's own network
            "enable_upnp": False,
            "enable_natpmp": False,
            "allow_multiple_connections_per_ip": True,  # every peer of a loopback swarm is 127.0.0.1
            # keep a peer whose pieces we do not want now: `--layers auto` fetches the header, then its range. Between
            # the two the torrent is finished, libtorrent would close its connections to the seeders as redundant, and
            # a tracker's peers are not dialled again before min_reconnect_time (60 s) has passed
            "close_redundant_connections": False,
            "announce_to_all_trackers": True,
            "announce_to_all_tiers": True,
            "alert_mask": lt.alert_category.error,
        }
        if dht_bootstrap is not None:
            from ..net.dht import dht_settings

            settings.update(dht_settings(list(dht_bootstrap)))
        self.session = lt.session(settings)
        self.dht = dht_bootstrap is not None
        self.handles: dict[str, lt.torrent_handle] = {}

    @property
    def port(self) -> int:
        """The TCP port peers connect to."""
        return self.session.listen_port()

    def _add(self, torrent: bytes, save_path: Path, priorities: list[int] | None) -> lt.torrent_handle:
        """The torrent's handle in this session: added, or (already added: a header fetched before the shard) with
        each piece's priority raised to ``priorities``' where that is higher (what it fetched stays wanted)."""
        added = self.handles.get(info_hash(torrent))
        if added is not None and added.is_valid():
            if priorities is not None:
                added.prioritize_pieces([max(a, b) for a, b in zip(added.get_piece_priorities(), priorities)])
            return added
        params = lt.add_torrent_params()
        params.ti = lt.torrent_info(lt.bdecode(torrent))
        params.save_path = str(save_path)
        if priorities is not None:
            params.piece_priorities = priorities
        handle = self.session.add_torrent(params)
        self.handles[info_hash(torrent)] = handle
        return handle

    def seed(self, torrent: bytes, save_path: Path, timeout: float = 600.0) -> lt.torrent_handle:
        """Seed files already under ``save_path`` (checks them against the torrent first).

        Raises SwarmError when the files do not match the torrent within ``timeout`` seconds.
        """
        handle = self._add(torrent, save_path, None)
        deadline = time.monotonic() + timeout
        checking = (lt.torrent_status.checking_files, lt.torrent_status.checking_resume_data)
        while True:
            st = handle.status()
            if st.is_seeding:
                return handle
            if st.errc.value():
                raise SwarmError(f"cannot seed from {save_path}: {st.errc.message()}")
            if st.state not in checking:
                raise SwarmError(
                    f"cannot seed from {save_path}: the files are incomplete or differ from the torrent "
                    f"({st.progress:.0%} verified)"
                )
            if time.monotonic() > deadline:
                raise SwarmError(f"cannot seed from {save_path}: checking the files took over {timeout:.0f} s")
            time.sleep(0.05)

    def fetch(
        self,
        torrent: bytes,
        save_path: Path,
        ranges: list[tuple[int, int, int]],
        peers=(),
        timeout: float = 600.0,
        progress: bool = True,
        stall_s: float = 60.0,
        on_stall: Callable[[list[int]], str] | None = None,
    ) -> FetchStats:
        """Download only the pieces overlapping ``ranges`` into ``save_path`` (sparse files), verified.

        ``peers``: extra ``(host, port)`` to connect to besides the tracker's. Shows a tqdm progress
        bar on stderr when ``progress`` (bytes, and the peers connected). When no new piece arrives for
        ``stall_s`` seconds (the only seeder died, none is up yet) it logs a warning saying so and retries:
        re-announces to the tracker (which may know new seeders by then) and reconnects ``peers``; again
        every ``stall_s`` while it stays stalled. ``on_stall(pieces)``, given the missing pieces that no connected
        peer holds (sorted piece indices), returns what the warning adds about them (which layers they are, who
        should hold them). Keeps seeding what it holds afterwards. Raises SwarmError after ``timeout`` seconds in
        all, or on a storage error.
        """
        ti = lt.torrent_info(lt.bdecode(torrent))
        wanted = pieces_for_ranges(torrent, ranges)
        priorities = [4 if i in wanted else 0 for i in range(ti.num_pieces())]
        t0 = time.monotonic()
        handle = self._add(torrent, save_path, priorities)
        for peer in peers:
            handle.connect_peer(peer)
        total = sum(ti.piece_size(i) for i in wanted)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="fetching shard",
                leave=False,
                disable=None,
            )  # None: no bar when stderr is not a terminal
        last_done, last_progress, shown_peers, last_kick = -1, t0, -1, t0
        held_before = {i for i in wanted if handle.have_piece(i)}  # on disk already: not checked again
        first_seen: dict[int, float] = {}  # piece → when this fetch first saw it held
        try:
            while True:
                have = [i for i in wanted if handle.have_piece(i)]
                for i in have:
                    if i not in held_before:
                        first_seen.setdefault(i, time.monotonic())
                done = sum(ti.piece_size(i) for i in have)
                st = handle.status()
                now = time.monotonic()
                if bar is not None:
                    if st.num_peers != shown_peers:
                        shown_peers = st.num_peers
                        bar.set_postfix_str(f"{shown_peers} peer{'' if shown_peers == 1 else 's'}", refresh=False)
                    bar.update(done - bar.n)
                if len(have) == len(wanted):
                    recent = [i for i, seen in first_seen.items() if seen > now - RECENT_PIECE_S]
                    _wait_written(ti, save_path, recent, timeout=WRITE_WAIT_S)
                    break
                if st.errc.value():
                    raise SwarmError(f"fetch failed: {st.errc.message()}")
                if now - t0 > timeout:
                    raise SwarmError(
                        f"fetch timed out after {timeout:.0f} s with {len(have)}/{len(wanted)} pieces "
                        f"({st.num_peers} peers connected)"
                    )
                if st.num_peers == 0 and now - last_kick > NO_PEER_RETRY_S:  # none yet: ask again soon, not after
                    last_kick = now  # stall_s (a DHT answer or a given peer that was not up a moment ago)
                    self._ask_for_peers(handle, peers)
                if done != last_done:
                    last_done, last_progress = done, now
                elif now - last_progress > stall_s:
                    why = "is a node holding these layers up?"
                    if on_stall is not None:
                        why = on_stall(self._unreachable(handle, wanted))
                    log.warning(
                        "fetch stalled: no new piece for %.0f s (%d/%d pieces, %d peers connected, %d of them "
                        "seeds). %s Retrying: asking the tracker for peers again; giving up after %.0f s in all",
                        now - last_progress,
                        len(have),
                        len(wanted),
                        st.num_peers,
                        st.num_seeds,
                        why,
                        timeout,
                    )
                    self._ask_for_peers(handle, peers)
                    last_progress = now
                time.sleep(0.05)
        finally:
            if bar is not None:
                bar.close()
        return FetchStats(len(wanted), handle.status().total_payload_download, time.monotonic() - t0)

    @staticmethod
    def _unreachable(handle: lt.torrent_handle, wanted: set[int]) -> list[int]:
        """The wanted pieces this session lacks and no connected peer has (sorted)."""
        missing = {i for i in wanted if not handle.have_piece(i)}
        for peer in handle.get_peer_info():
            held = peer.pieces
            missing = {i for i in missing if not (i < len(held) and held[i])}
        return sorted(missing)

    def _ask_for_peers(self, handle: lt.torrent_handle, peers) -> None:
        """Re-announce to the trackers (and the DHT) and connect the given ``peers`` again."""
        handle.force_reannounce()
        if self.dht:
            handle.force_dht_announce()
        for peer in peers:
            handle.connect_peer(peer)

    def uploaded(self, torrent: bytes) -> int:
        """Payload bytes this session has uploaded for ``torrent``."""
        return self.handles[info_hash(torrent)].status().total_payload_upload

    def close(self) -> None:
        """Stop all torrents and the session."""
        for handle in self.handles.values():
            self.session.remove_torrent(handle)
        self.handles.clear()
