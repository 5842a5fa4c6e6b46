"""The floor of a hop on this machine: three processes pass one message around a ring of aiohttp WebSockets, each
busy-waiting a given "compute" time per pass before it sends the message on, as the route's nodes compute their
shards; no ggufswarm code, no llama.cpp. The period less the summed busy-waits, divided by the hops, is what one hop
costs in the operating system, the event loop and aiohttp alone: where an idle processor wakes slowly (a virtual
machine without halt polling, for one) most of it is the wake-up of the process that waited for the message.
``--raw``: the same ring over plain TCP sockets with blocking reads and writes (no event loop, no WebSocket framing):
the operating system's part alone. ``bench/bench_ring.py`` prints both beside the route's per-hop overhead.

Usage (alone): .venv/bin/python bench/bare_ring.py [--compute-ms 3,3,17] [--passes 200] [--raw]
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import socket
import subprocess
import sys

WARM = 20  # untimed rounds first

NODE = r"""
import asyncio, statistics, sys, time
import aiohttp
from aiohttp import web

port, next_port, busy_ms, passes, warm = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
                                          int(sys.argv[5]))

async def main():
    http = aiohttp.ClientSession()
    out = None
    stamps = []

    async def link(request):
        nonlocal out
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.BINARY:
                continue
            t = time.perf_counter()
            if passes:  # the timing node: the period between arrivals
                stamps.append(t)
                if len(stamps) == warm + passes + 1:
                    periods = [(b - a) * 1e3 for a, b in zip(stamps[warm:], stamps[warm + 1:])]
                    print(f"{statistics.median(periods):.4f}", flush=True)
                    continue
            while time.perf_counter() - t < busy_ms / 1e3:
                pass
            if out is None:
                out = await http.ws_connect(f"http://127.0.0.1:{next_port}/link", max_msg_size=0)
            await out.send_bytes(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/link", link)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

# the same over blocking TCP sockets: the first process (the timing one) opens the ring by sending the message
RAW_NODE = r"""
import socket, statistics, sys, time

port, next_port, passes, warm, size = (int(sys.argv[i]) for i in (1, 2, 4, 5, 6))
busy_ms = float(sys.argv[3])
server = socket.create_server(("127.0.0.1", port))
print("ready", flush=True)
out = None

def connect():
    s = socket.create_connection(("127.0.0.1", next_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

if passes:
    sys.stdin.readline()  # every node listens: start the ring
    out = connect()
    out.sendall(b"x" * size)
conn = server.accept()[0]
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
stamps = []
while True:
    got = 0
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            sys.exit(0)
        got += len(chunk)
    t = time.perf_counter()
    if passes:
        stamps.append(t)
        if len(stamps) == warm + passes + 1:
            periods = [(b - a) * 1e3 for a, b in zip(stamps[warm:], stamps[warm + 1:])]
            print(f"{statistics.median(periods):.4f}", flush=True)
            sys.exit(0)
    while time.perf_counter() - t < busy_ms / 1e3:
        pass
    if out is None:
        out = connect()
    out.sendall(b"x" * size)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` prints, waiting at most ``timeout`` s (RuntimeError after)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"the bare ring did not come round within {timeout:g} s")
    return proc.stdout.readline().decode().strip()


async def _inject(port: int, payload: int) -> None:
    """Start the aiohttp ring: one message to the first process."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"http://127.0.0.1:{port}/link", max_msg_size=0)
        await ws.send_bytes(b"x" * payload)
        await ws.close()


def bare_ring(compute_ms: list[float], passes: int = 200, payload: int = 2600, raw: bool = False) -> dict:
    """Run the ring: one process per entry of ``compute_ms`` (busy-wait ms per pass), each sending on to the next and
    the last to the first, a ``payload``-byte message (a Gemma 3 270M f32 frame is ~2.6 KB) going round ``passes``
    times after WARM untimed rounds; the first process times the rounds. ``raw``: over blocking TCP sockets (no event
    loop, no aiohttp). ``{"period_ms": median ms per round, "hop_ms": (period - sum(compute_ms)) / hops}``.
    RuntimeError when the ring does not come round in 60 s."""
    ports = [_free_port() for _ in compute_ms]
    procs = []
    try:
        for i, busy in enumerate(compute_ms):
            nxt = ports[(i + 1) % len(ports)]
            args = [str(ports[i]), str(nxt), str(busy), str(passes if i == 0 else 0), str(WARM), str(payload)]
            proc = subprocess.Popen(
                [sys.executable, "-c", RAW_NODE if raw else NODE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            procs.append(proc)
            if _read_line(proc, 60.0) != "ready":
                raise RuntimeError("a bare ring node did not start")
        if raw:
            procs[0].stdin.write(b"go\n")
            procs[0].stdin.flush()
        else:
            asyncio.run(_inject(ports[0], payload))
        period = float(_read_line(procs[0], 60.0))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"period_ms": period, "hop_ms": (period - sum(compute_ms)) / len(compute_ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compute-ms", default="3,3,17", help="busy-wait ms per pass of each node (default 3,3,17)")
    ap.add_argument("--passes", type=int, default=200, help="timed rounds (default 200)")
    ap.add_argument("--raw", action="store_true", help="blocking TCP sockets: no event loop, no aiohttp")
    args = ap.parse_args()
    compute = [float(x) for x in args.compute_ms.split(",")]
    out = bare_ring(compute, args.passes, raw=args.raw)
    print(f"period {out['period_ms']:.2f} ms for {sum(compute):.1f} ms of busy-wait: {out['hop_ms']:.3f} ms per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
