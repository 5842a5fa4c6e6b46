"""Model artifacts over a loopback BitTorrent swarm: partial layer-range fetch, verification, seeding."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.artifact.manifest import Manifest
from ggufswarm.swarm.torrent import Swarm, SwarmError, make_torrent


@pytest.fixture(scope="module")
def artifact(gemma_path):
    manifest = Manifest.from_gguf(gemma_path)
    return manifest, make_torrent([gemma_path])


@pytest.fixture(scope="module")
def seeders(artifact, gemma_path, tmp_path_factory):
    """Three seeders, each with its own copy of the file."""
    _, torrent = artifact
    out = []
    for i in range(3):
        d = tmp_path_factory.mktemp(f"seed{i}")
        shutil.copy(gemma_path, d / gemma_path.name)
        swarm = Swarm()
        swarm.seed(torrent, d)
        out.append((swarm, d))
    yield out
    for swarm, _ in out:
        swarm.close()


def _disk_bytes(path) -> int:
    return path.stat().st_blocks * 512


def test_manifest_indexes_layers(artifact, gemma_path):
    manifest, _ = artifact
    assert manifest.arch == "gemma3" and manifest.n_layers == 18
    assert manifest.files[0]["bytes"] == gemma_path.stat().st_size and len(manifest.files[0]["sha256"]) == 64
    assert Manifest.from_json(manifest.to_json()) == manifest
    # against the GGUF's own tensor table as gguf-py (llama.cpp's reader) reads it
    reader = GGUFReader(gemma_path)
    assert manifest.files[0]["header_bytes"] == reader.data_offset
    assert {t.name: (t.offset, t.n_bytes) for t in manifest.tensors} == {
        t.name: (int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
    }
    want = [0] * 18
    for t in reader.tensors:
        if m := re.match(r"blk\.(\d+)\.", t.name):
            want[int(m[1])] += int(t.n_bytes)
    assert manifest.layer_bytes() == want and min(want) > 0


def test_partial_fetch_downloads_only_the_shard(artifact, seeders, gemma_path, tmp_path, monkeypatch):
    """Only the shard's pieces (and the header) are fetched; the progress bar shows the peers connected."""
    import tqdm

    postfixes = []

    class Bar(tqdm.tqdm):  # the real bar, forced on (stderr is no terminal here), its peer counts recorded
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False})

        def set_postfix_str(self, s="", refresh=True):
            postfixes.append(s)
            super().set_postfix_str(s, refresh)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    manifest, torrent = artifact
    ranges = manifest.byte_ranges(6, 12)
    header = manifest.files[0]["header_bytes"]
    shard_bytes = sum(manifest.layer_bytes()[6:12])
    piece = 256 * 1024
    bound = 1.05 * (shard_bytes + header + 2 * len(ranges) * piece)
    leech = Swarm()
    try:
        stats = leech.fetch(
            torrent, tmp_path, ranges, peers=[("127.0.0.1", s.port) for s, _ in seeders[1:]], timeout=120, progress=True
        )
        assert postfixes and all(re.fullmatch(r"\d+ peers?", p) for p in postfixes), postfixes
        assert any(int(p.split()[0]) >= 1 for p in postfixes), postfixes  # the seeders it was given connected
        path = tmp_path / gemma_path.name
        print(
            f"downloaded {stats.bytes_downloaded} B for {shard_bytes} B of blocks + {header} B header; "
            f"{_disk_bytes(path)} B on disk; {stats.seconds:.2f} s"
        )
        assert stats.bytes_downloaded <= bound
        assert _disk_bytes(path) <= bound
        fetched, original = GGUFModelFile(path), GGUFModelFile(gemma_path)
        for t in manifest.tensors:
            if t.layer is not None and 6 <= t.layer < 12:
                assert np.array_equal(fetched.read_raw(t.name), original.read_raw(t.name)), t.name
    finally:
        leech.close()


def test_corrupt_piece_is_rejected_and_fetched_elsewhere(artifact, seeders, gemma_path, tmp_path):
    """A seeder whose file went bad after it verified it: its pieces fail the hash check and are fetched from
    the others. (The bad seeder is this test's own: the shared ones stay sound for the other tests.)"""
    manifest, torrent = artifact
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    shutil.copy(gemma_path, bad_dir / gemma_path.name)
    bad = Swarm()
    bad.seed(torrent, bad_dir)
    target = next(t for t in manifest.tensors if t.layer == 13)
    with open(bad_dir / gemma_path.name, "r+b") as f:  # corrupt after the seeder verified its file
        f.seek(target.offset + 4096)
        f.write(b"\xff" * 8192)
    leech = Swarm()
    try:
        leech.fetch(
            torrent,
            tmp_path / "leech",
            manifest.byte_ranges(13, 14),
            peers=[("127.0.0.1", s.port) for s, _ in [(bad, bad_dir)] + seeders],
            timeout=120,
            progress=False,
        )
        fetched = GGUFModelFile(tmp_path / "leech" / gemma_path.name)
        original = GGUFModelFile(gemma_path)
        for t in manifest.tensors:
            if t.layer == 13:
                assert np.array_equal(fetched.read_raw(t.name), original.read_raw(t.name)), t.name
    finally:
        leech.close()
        bad.close()


def test_three_seeders_share_the_upload(artifact, seeders, tmp_path):
    manifest, torrent = artifact
    before = [s.uploaded(torrent) for s, _ in seeders]
    leech = Swarm()
    try:
        leech.fetch(
            torrent,
            tmp_path,
            manifest.byte_ranges(0, 18, embed=True, head=True),
            peers=[("127.0.0.1", s.port) for s, _ in seeders],
            timeout=180,
            progress=False,
        )
    finally:
        leech.close()
    gained = [s.uploaded(torrent) - b for (s, _), b in zip(seeders, before)]
    print("uploaded per seeder:", gained)
    assert all(g > 0 for g in gained)


def test_seeding_wrong_files_is_a_clear_error(artifact, tmp_path, gemma_path):
    _, torrent = artifact
    (tmp_path / gemma_path.name).write_bytes(b"not the model")
    with pytest.raises(SwarmError, match="differ from the torrent"):
        Swarm().seed(torrent, tmp_path, timeout=30)


def test_split_set_is_one_artifact(tiny_dir, tmp_path):
    from tinymodels import write_tiny_model

    from ggufswarm.client.local import LocalModel

    src = tiny_dir / "splitpub"
    src.mkdir()
    first = write_tiny_model(src / "tiny.gguf", "llama", n_layers=4, split_max_tensors=12)
    manifest = Manifest.from_gguf(first, name="tiny")
    assert len(manifest.files) > 1
    torrent = make_torrent(sorted(src.glob("tiny-*.gguf")))
    seeder, leech = Swarm(), Swarm()
    try:
        seeder.seed(torrent, src.parent)
        leech.fetch(
            torrent,
            tmp_path,
            manifest.byte_ranges(0, 4, embed=True, head=True),
            peers=[("127.0.0.1", seeder.port)],
            timeout=60,
            progress=False,
        )
    finally:
        seeder.close()
        leech.close()
    fetched = tmp_path / src.name / first.name
    ids = list(range(3, 20))
    assert np.array_equal(
        LocalModel.load(fetched).session(32).logits(ids), LocalModel.load(first).session(32).logits(ids)
    )


def test_a_stalled_fetch_says_so_and_completes_once_a_seeder_appears(tiny_dir, tmp_path, caplog):
    """No piece arrives (the only peer does not have the torrent yet): the fetch warns within its stall time,
    keeps retrying (reconnecting its peers), and completes, verified, once the peer seeds."""
    import threading
    import time

    from tinymodels import write_tiny_model

    src = tiny_dir / "stallpub"
    src.mkdir()
    model = write_tiny_model(src / "tiny.gguf", "llama", n_layers=2)
    manifest = Manifest.from_gguf(model, name="tiny")
    torrent = make_torrent([model])
    seeder, leech = Swarm(), Swarm()
    result: dict = {}

    def fetch():
        try:
            result["stats"] = leech.fetch(
                torrent,
                tmp_path,
                manifest.byte_ranges(0, 2, embed=True, head=True),
                peers=[("127.0.0.1", seeder.port)],
                timeout=60,
                progress=False,
                stall_s=0.3,
            )
        except Exception as exc:
            result["error"] = exc

    caplog.set_level("WARNING", logger="ggufswarm.swarm.torrent")
    thread = threading.Thread(target=fetch)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while "fetch stalled" not in caplog.text and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.05)
        assert "fetch stalled" in caplog.text and "0/" in caplog.text and thread.is_alive()
        seeder.seed(torrent, src)
        thread.join(60)
        assert not thread.is_alive() and "error" not in result, result
    finally:
        thread.join(60)
        seeder.close()
        leech.close()
    assert result["stats"].pieces > 0
    assert (tmp_path / model.name).read_bytes() == model.read_bytes()


def test_auto_layers_pick_the_least_covered_range(artifact):
    """``--layers auto``: a range on the swarm's existing cuts that fits the budget (blocks + embedding/head bytes),
    the least covered first, so the node can replace or chain with the others; else a window as wide as fits."""
    from ggufswarm.directory.routing import Advertisement
    from ggufswarm.swarm.shard_fetch import choose_layers, shard_bytes

    manifest, _ = artifact
    n = manifest.n_layers
    assert n == 18
    assert shard_bytes(manifest, 12, 18) > sum(manifest.layer_bytes()[12:18])  # the head's tensors count
    ads = [Advertisement("a", "u", "m", (0, 6), True), Advertisement("b", "u", "m", (6, 12))]
    spec = choose_layers(manifest, ads, shard_bytes(manifest, 12, 18))
    assert (spec.start, spec.end, spec.head) == (12, 18, True)  # uncovered, and it fits exactly
    budget = shard_bytes(manifest, 12, 18) - 1
    spec = choose_layers(manifest, ads, budget)  # the head does not fit: an aligned range that does (ties: lowest)
    assert (spec.start, spec.end) == ((0, 6) if shard_bytes(manifest, 0, 6) <= budget else (6, 12))
    spec = choose_layers(
        manifest, ads + [Advertisement("c", "u", "m", (12, 18), head=True)] * 2, shard_bytes(manifest, 0, 6)
    )
    assert (spec.start, spec.end, spec.embed) == (0, 6, True)  # ties on coverage go to the lowest range
    spec = choose_layers(manifest, [Advertisement("a", "u", "m", (0, 9), True)], shard_bytes(manifest, 0, 18))
    assert (spec.start, spec.end, spec.head) == (9, 18, True)  # aligned with the only node: it chains after it
    assert shard_bytes(manifest, spec.start, spec.end) <= shard_bytes(manifest, 0, 18)
    tight = choose_layers(manifest, [], 1)  # nothing fits: one block
    assert tight.end - tight.start == 1
    window = choose_layers(manifest, ads, shard_bytes(manifest, 6, 9))  # no aligned range fits: a window
    assert shard_bytes(manifest, window.start, window.end) <= shard_bytes(manifest, 6, 9) and window.start >= 6


def without_0011(metadata, start, end, head):
    """The range check of a node whose llama.cpp lacks patch 0011 (a range of one kind of block refused)."""
    from ggufswarm.artifact.cut_rules import range_problem

    return range_problem(metadata, start, end, head, one_kind=False)


def test_auto_layers_keep_to_the_cut_rules(artifact, gemma_path):
    """``--layers auto`` with the model's cut rules (``artifact/cut_rules.py``, the node's start-up check): Gemma 3's
    blocks 5, 11 and 17 are its only full-attention ones, and a range of one of them alone is refused by a node whose
    llama.cpp lacks patch 0011 (it asserts a sliding-window layer in every shard; with the patch it runs); the least
    covered block here is block 5, which the rules' choice for such a node avoids while the blind one takes it."""
    from ggufswarm.directory.routing import Advertisement
    from ggufswarm.swarm.shard_fetch import _cuttable, choose_layers, shard_bytes

    manifest, _ = artifact
    assert _cuttable(gemma_path, manifest.n_layers)(5, 6)  # patch 0011 (what plan assumes)
    cuttable = _cuttable(gemma_path, manifest.n_layers, without_0011)
    assert cuttable(0, 6) and cuttable(4, 5) and not cuttable(5, 6)
    ads = [Advertisement("a", "u", "m", (0, 5), True), Advertisement("b", "u", "m", (6, 18), head=True)]
    budget = shard_bytes(manifest, 5, 6)
    blind = choose_layers(manifest, ads, budget)
    assert (blind.start, blind.end) == (5, 6)
    ruled = choose_layers(manifest, ads, budget, cuttable)
    assert cuttable(ruled.start, ruled.end) and shard_bytes(manifest, ruled.start, ruled.end) <= budget
    assert choose_layers(manifest, ads, budget, lambda s, e: False) == blind  # nothing allowed fits: as before


def test_fetch_shard_auto_reads_the_header_first_and_fetches_a_range_the_node_runs(
    artifact, seeders, gemma_path, tmp_path
):
    """``fetch_shard(layers="auto")`` from a directory listing one node (blocks 0:5) and the seeders: it fetches the
    header, picks a range by the cut rules within the budget (one block: not the full-attention block 5, for a node
    without patch 0011), then that range's pieces into the same torrent (the header's priorities stay), verified."""
    from ggufswarm.swarm.shard_fetch import _cuttable, fetch_shard, shard_bytes

    manifest, torrent = artifact
    found = {"manifest": json.loads(manifest.to_json()), "torrent_hex": torrent.hex()}
    reach = [{"reach": {"torrent": f"127.0.0.1:{s.port}"}} for s, _ in seeders]
    listed = [
        {"node_id": "a", "url": "http://a", "model": "m", "layers": [0, 5], "embed": True, "head": False,
         "state": "serving", "extra": reach[0]},
        {"node_id": "b", "url": "http://b", "model": "m", "layers": [6, 18], "embed": False, "head": True,
         "state": "serving", "extra": reach[1]},
    ]  # fmt: skip

    class Listing:
        async def manifest(self, http):
            return found

        async def nodes(self, http):
            return listed

    fetched = fetch_shard(
        None, "m", "auto", False, False, tmp_path, shard_bytes(manifest, 5, 6), timeout=120, progress=False,
        directory=Listing(), range_check=without_0011,
    )  # fmt: skip
    try:
        spec = fetched.spec
        assert spec.end - spec.start == 1 and spec.start != 5
        assert _cuttable(fetched.path, manifest.n_layers, without_0011)(spec.start, spec.end)
        data = fetched.path.read_bytes()
        original = gemma_path.read_bytes()
        for t in manifest.tensors:
            if t.layer == spec.start:
                assert data[t.offset : t.offset + t.n_bytes] == original[t.offset : t.offset + t.n_bytes], t.name
        header = manifest.files[0]["header_bytes"]
        assert data[:header] == original[:header]
    finally:
        fetched.swarm.close()
