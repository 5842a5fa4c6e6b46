"""The llama.cpp references of the tests are computed on the machine that runs them (tests/llamacpp_reference.py)."""

from __future__ import annotations

import json

import pytest
from llamacpp_reference import ForeignReference, cached, load, machine_key


def test_a_reference_made_on_another_cpu_kind_is_refused(tmp_path):
    """A cached reference is reused on the machine that made it; one whose machine key differs (here: written on an
    AVX2-only CPU) is refused by ``load`` and computed anew by ``cached``, never used."""
    calls = []

    def compute():
        calls.append(1)
        return {"ppl": 18.1665}

    assert cached("ref", {"n_ctx": 256}, compute, tmp_path) == {"ppl": 18.1665}
    assert cached("ref", {"n_ctx": 256}, compute, tmp_path) == {"ppl": 18.1665} and len(calls) == 1
    [path] = tmp_path.glob("ref-*.json")
    doc = json.loads(path.read_text())
    assert doc["machine"] == machine_key() and "AVX" in doc["machine"]["llama_system_info"]
    doc["machine"]["cpu_flags"] = "avx avx2 f16c fma sse sse2"  # the same file, as an AVX2-only machine wrote it
    doc["value"] = {"ppl": 18.0910}
    path.write_text(json.dumps(doc))
    with pytest.raises(ForeignReference, match="cpu_flags"):
        load(path)
    with pytest.warns(UserWarning, match="another machine"):
        assert cached("ref", {"n_ctx": 256}, compute, tmp_path) == {"ppl": 18.1665}
    assert len(calls) == 2 and load(path) == {"ppl": 18.1665}


def test_the_machine_key_names_what_sets_llama_cpp_s_bits():
    key = machine_key()
    assert key["cpu_flags"] and key["cpu_model"] and key["llama_cpp_python"]
    assert key["build_sha256"] and all(len(h) == 64 for h in key["build_sha256"].values())
    assert any(name.startswith("libggml-cpu") for name in key["build_sha256"])  # the kernels' library
