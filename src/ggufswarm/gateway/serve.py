"""``ggufswarm gateway``'s start-up: warn about an open gateway, wait for its route (checked) or its tracker, then
serve the app in the foreground."""

from __future__ import annotations

import sys
import time

from ..artifact.default_model import resolve_model
from ..artifact.gguf_file import GGUFModelFile
from ..client.route import RemoteRoute
from ..directory.trackers import TrackerClient
from ..net.addresses import is_loopback
from ..net.http import run_server
from ..protocol.errors import RouteError
from .app import make_app
from .config import GatewayConfig

CHECK_HOP_TIMEOUT_S = 10.0  # check_route: most seconds one node may take to answer
FINGERPRINT_SHOWN = 12  # hex digits of a model fingerprint an error names


def check_route(config: GatewayConfig, every_s: float = 2.0) -> RemoteRoute:
    """``gateway --route``, before serving: the route's nodes answer, carry the swarm token, chain from the
    embedding to the head, and serve one model (``--model``'s, when given). A node that does not answer yet
    is waited for (one line on stderr per new reason, then a retry every ``every_s`` s: start order does not
    matter); a route that cannot work (bad chain, other model, wrong token) raises ValueError saying why."""
    model = GGUFModelFile(resolve_model(config.model)) if config.model else None
    said = None
    while True:
        try:
            return RemoteRoute(
                config.route,
                min(config.hop_timeout_s, CHECK_HOP_TIMEOUT_S),
                model=model and model.fingerprint,
                token=config.token,
            )
        except ValueError as exc:
            mine = f" (--model {model.path.name}: fingerprint {model.fingerprint[:FINGERPRINT_SHOWN]})" if model else ""
            raise ValueError(f"bad route: {exc}{mine}") from None
        except RouteError as exc:
            if exc.status in (401, 403):
                raise ValueError(f"bad route: {exc} (give the nodes' --token)") from None
            if str(exc) != said:
                print(
                    f"ggufswarm gateway: waiting for the route: {exc}; retrying every {every_s:g} s",
                    file=sys.stderr,
                    flush=True,
                )
                said = str(exc)
        time.sleep(every_s)


def run_gateway(config: GatewayConfig) -> int:
    """``ggufswarm gateway``: check the route (``--route``; see check_route), then serve until SIGINT/SIGTERM,
    printing one ready line to stdout."""
    if not config.api_keys and not is_loopback(config.host):
        print(
            f"ggufswarm gateway: WARNING: listening on {config.host} without --api-key: anyone who can reach "
            f"this port can generate (and hold KV cache on every node of the swarm); set --api-key",
            file=sys.stderr,
            flush=True,
        )
    if config.route and not config.tracker:
        check_route(config)
    if config.tracker and not config.dht:  # start order does not matter: wait for the tracker (and the model)
        TrackerClient(config.tracker, config.token).wait_for_model(config.model, who="gateway")
    app = make_app(config)

    def ready(url: str) -> None:
        where = f"tracker {config.tracker}" if config.tracker else f"route {','.join(config.route)}"
        if config.dht:
            where = (f"tracker {config.tracker}; " if config.tracker else "") + f"DHT contacts {','.join(config.dht)}"
        print(f"ggufswarm gateway ready: {url}/v1 {where}", flush=True)

    run_server(app, config.host, config.port, ready)
    print("ggufswarm gateway: stopped", file=sys.stderr, flush=True)
    return 0
