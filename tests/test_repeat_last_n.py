"""``repeat_last_n``: the repeat penalty looks only at the last N tokens (prompt included), on both heads' samplers
and through the gateway's OpenAI API."""

from __future__ import annotations

import pytest
import torch
from apphost import AppThread
from route_fixtures import http
from tinymodels import write_tiny_model

from ggufswarm.artifact.gguf_file import GGUFModelFile
from ggufswarm.client.tokenizer import Tokenizer
from ggufswarm.gateway import GatewayConfig, make_app
from ggufswarm.net.http import ServerThread
from ggufswarm.node.app import make_app as make_node_app
from ggufswarm.node.state import NodeConfig
from ggufswarm.runtime.llamacpp.sampling import LlamaCppSampler
from ggufswarm.runtime.sampling import SamplingParams
from ggufswarm.runtime.torch_sampling import Sampler


@pytest.mark.parametrize("sampler", [Sampler, LlamaCppSampler], ids=["torch", "llama.cpp"])
def test_repeat_penalty_applies_only_inside_the_last_n(sampler):
    """Token 7 (the top logit) was seen 5 tokens back: with N >= 5 it is penalized (9 wins), with N < 5 it is not
    (only the ids of the last N are touched), and N = 0 turns the penalty off."""
    logits = torch.zeros(100)
    logits[7], logits[9] = 5.0, 4.0
    history = [7, 1, 2, 3, 4]

    def draw(n: int) -> int:
        return sampler(SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=n)).sample(logits, history)

    assert [draw(n) for n in (0, 1, 4, 5, 6, 64)] == [7, 7, 7, 9, 9, 9]
    logits[1:5] = torch.tensor([1.0, -1.0, 2.0, -2.0])
    adjusted = sampler(SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=3)).adjust(logits, history)
    want = logits.clone()
    want[2:5] = torch.tensor([-2.0, 1.0, -4.0])  # ids 2, 3, 4: positive halved, negative doubled
    torch.testing.assert_close(torch.as_tensor(adjusted), want)  # 7 and 1 (further back) untouched


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return write_tiny_model(tiny_dir / "repeat-last-n.gguf", "llama", n_layers=2, seed=11)


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_gateway_repeat_last_n_window(tiny_model, tiny_dir, backend):
    """Through /v1/completions: the prompt's first word ``X`` (" b") gets logit bias +50 and an unseen one ``Y``
    (" z") +40, with repeat_penalty 100. ``X`` is 10 tokens from the end of the 11-token prompt (BOS, 10 words): with
    repeat_last_n 10
    or more (and -1, the context) the penalty reaches it and ``Y`` is generated; with 9 or less (and 0, off) it does
    not, and ``X`` is. The head's sampler (torch or llama.cpp) gets N from the request."""
    words = "b c d e f g h i j k"
    tok = Tokenizer(str(tiny_model), GGUFModelFile(tiny_model).metadata)
    ids = tok.encode(words)
    assert len(ids) == 11 and ids[0] == 1 and len(set(ids)) == 11, ids
    x = ids[1]
    y = tok.encode("z", add_bos=False)
    assert len(y) == 1 and y[0] not in ids
    y = y[0]
    node = AppThread(
        lambda: make_node_app(
            NodeConfig(
                layers="0:2",
                embed=True,
                head=True,
                model=str(tiny_model),
                backend=backend,
                data_dir=str(tiny_dir / f"rln-{backend}"),
            )
        )
    )
    with node as url:
        gateway = ServerThread(make_app(GatewayConfig([url], model=str(tiny_model))))
        base = gateway.start()
        try:

            def first_token(n: int) -> int:
                status, out = http(
                    "POST",
                    base + "/v1/completions",
                    {
                        "prompt": words,
                        "max_tokens": 1,
                        "temperature": 0,
                        "repeat_penalty": 100.0,
                        "repeat_last_n": n,
                        "logit_bias": {str(x): 50, str(y): 40},
                    },
                )
                assert status == 200, out
                assert out["usage"]["prompt_tokens"] == len(ids)
                text = out["choices"][0]["text"]
                assert text in (tok.decode([x]), tok.decode([y])), (text, n)
                return x if text == tok.decode([x]) else y

            got = {n: first_token(n) for n in (0, 1, 9, 10, 11, 64, -1)}
        finally:
            gateway.stop()
    assert got == {0: x, 1: x, 9: x, 10: y, 11: y, 64: y, -1: y}, (got, x, y)
