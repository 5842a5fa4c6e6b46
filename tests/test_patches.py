"""ggufswarm's llama.cpp patch queue (patches/llama.cpp): every patch is documented, known to the runtime, and in
the libllama ``make setup`` built."""

from __future__ import annotations

from pathlib import Path

from ggufswarm.runtime.llamacpp import patches

QUEUE = Path(__file__).resolve().parent.parent / "patches" / "llama.cpp"


def test_every_patch_has_a_header_and_a_marker():
    """Each patch file starts with what it changes, why, and the upstream issue it answers; the runtime knows a string
    it leaves in libllama (so a node can tell whether it is there), and every marker belongs to a patch; a patch
    that only lets llama.cpp compile (``BUILD_ONLY``) adds lines under a preprocessor conditional only."""
    files = sorted(QUEUE.glob("*.patch"))
    assert files
    for f in files:
        text = f.read_text()
        header, _, diff = text.partition("\n---\n")
        assert diff.startswith("diff "), f.name
        for part in ("Subject:", "What", "Why:", "Upstream:"):
            assert part in header, (f.name, part)
        if f.stem in patches.BUILD_ONLY:
            assert f.stem not in patches.PATCH_MARKERS, f.name
            added = [
                line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
            ]
            assert added and added[0].startswith("#if") and added[-1].startswith("#endif"), f.name
            continue
        assert f.stem in patches.PATCH_MARKERS, f.name
        # the marker is a string the patch adds
        assert any(
            line.startswith("+") and patches.PATCH_MARKERS[f.stem].decode() in line for line in diff.splitlines()
        ), f.name
    assert set(patches.PATCH_MARKERS) | patches.BUILD_ONLY == {f.stem for f in files}


def test_the_installed_libllama_carries_the_whole_queue():
    """``make setup`` installs llama-cpp-python built with every patch of the queue."""
    missing = [name for name in patches.PATCH_MARKERS if not patches.applied(name)]
    assert not missing, f"{patches.libllama_path()} lacks {missing}: rerun make setup"
