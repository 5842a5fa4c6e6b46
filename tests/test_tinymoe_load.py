"""llama.cpp loads every tiny MoE GGUF of ``tinymoe`` and gives finite, non-constant logits."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from tinymoe import MOE_ARCHS, write_tiny_moe_model


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_llama_cpp_loads_tiny_moe(tmp_path, arch):
    path = write_tiny_moe_model(tmp_path / f"{arch}.gguf", arch)
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    try:
        tokens = [1, 300, 301, 302, 303, 310, 320, 330, 340, 350, 360, 370]
        llm.eval(tokens)
        logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        assert logits.shape == (len(tokens), llm.n_vocab())
        assert np.isfinite(logits).all()
        assert logits.std(axis=-1).min() > 0  # not all equal within a row
        assert np.abs(logits[1:] - logits[:-1]).max() > 0  # and positions differ
    finally:
        llm.close()
