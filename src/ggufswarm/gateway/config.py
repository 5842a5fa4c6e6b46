"""The gateway's settings (``ggufswarm gateway``'s flags, the demo's and the tests' gateways)."""

from __future__ import annotations

from dataclasses import dataclass

from ..client.speculative import DEFAULT_DRAFT_MAX

DEFAULT_HOP_TIMEOUT_S = 30.0
DEFAULT_SESSION_LEASE_S = 30.0
DEFAULT_VERIFY_RATE = 0.02  # ``ggufswarm gateway --verify-rate``'s default (a GatewayConfig's is 0: tests, benches)


@dataclass
class GatewayConfig:
    """Gateway settings. ``route``: node URLs in order; ``hop_timeout_s``: seconds one hop may take (see
    RemoteRoute)."""

    route: list[str]
    model: str | None = None
    model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    hop_timeout_s: float = DEFAULT_HOP_TIMEOUT_S
    wire_dtype: str = "f32"
    default_max_tokens: int = 512
    workers: int = 8  # threads for blocking work (tokenizing prompts, loading a vocabulary); generations run on
    # the event loop, not here
    api_keys: tuple[str, ...] = ()  # when set, /v1/* needs ``Authorization: Bearer KEY`` (OpenAI style)
    tracker: str | None = None  # plan a route per session from this tracker (``route`` unused)
    token: str | None = None  # swarm token, sent to the tracker and the nodes (None: an open swarm)
    more_trackers: tuple[str, ...] = ()  # further trackers of the swarm (a join link's): asked when ``tracker`` is not
    dht: tuple[str, ...] = ()  # DHT bootstrap contacts (``--join``): plan routes from the DHT when no tracker answers
    model_id: str | None = None  # the model's identity (manifest digest) naming its DHT key (``--join``)
    dht_port: int = 0  # UDP/TCP port of the gateway's own DHT session (0: any)
    data_dir: str = "ggufswarm-data"  # where the vocabulary (GGUF header) fetched from the swarm goes
    # /v1/completions: read control-token text in a raw prompt as control tokens (as llama-server does), or
    # as literal text (``--literal-prompts``). Chat messages are always literal (Tokenizer.encode_chat).
    prompt_special: bool = True
    session_lease_s: float = DEFAULT_SESSION_LEASE_S  # nodes drop a session idle this long: a gateway that dies
    # frees its KV that soon
    chat_template: str | None = None  # jinja2 chat template used instead of the GGUF's (``--chat-template-file``)
    speculative: str = "none"  # "ngram": prompt-lookup drafts verified by the route (client.speculative), or "none"
    ring: bool = True  # ring decode: the head sends each next decode step itself (client/ring.py)
    draft_max: int = DEFAULT_DRAFT_MAX  # most tokens drafted per verify step (a request's speculative.n_max lowers it)
    draft_model: str | None = None  # speculative "draft": a small GGUF of the served model's vocabulary, run here
    draft_threads: int = 1  # its llama.cpp threads
    draft_sessions: int = 4  # requests drafting at once (others decode without drafts)
    # fraction of (session, hop) pairs audited by shadow replay (gateway/verify.py); 0: off, sessions open without
    # step commitments. The command's default is DEFAULT_VERIFY_RATE; a config made in code verifies when asked
    verify_rate: float = 0.0
