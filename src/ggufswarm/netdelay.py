"""WAN emulation: a TCP proxy that delays every byte by a fixed one-way latency, in both directions.

Used by the tests and ``bench/bench_wan.py`` to put a route's hops "far apart" on one machine, where
``tc qdisc ... netem delay`` is not available (it needs the kernel's sch_netem module and CAP_NET_ADMIN).
A chunk read from one side is written to the other ``delay_ms`` after it was read, in order, without a
bandwidth limit: a request/reply exchange across the proxy costs ``2 * delay_ms`` more than a direct one,
as it would across a link with that one-way latency. Everything else (HTTP, WebSocket upgrades, llama.cpp
RPC) passes through unchanged.

Usage (CLI): ``python -m ggufswarm.netdelay --listen 127.0.0.1:9001 --target 127.0.0.1:8001 --delay-ms 25``
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

CHUNK = 1 << 16  # bytes read per call


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived; close ``writer`` at EOF."""
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                break
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            queue.put_nowait((time.monotonic() + delay_s, data or None))
            if not data:
                break
        await sender
    except (ConnectionError, asyncio.CancelledError):
        sender.cancel()
    finally:
        try:
            writer.close()
        except Exception:
            pass


class DelayProxy:
    """A delaying TCP proxy ``listen`` -> ``target`` (``(host, port)``) with ``delay_ms`` one-way latency.

    ``start()`` runs it on a background thread with its own event loop and returns its ``host:port``
    (port 0 picks a free one); ``stop()`` closes it and every connection through it. ``url`` is
    ``http://host:port`` once started. OSError when the listen address is taken.
    """

    def __init__(self, target: tuple[str, int], delay_ms: float, listen: tuple[str, int] = ("127.0.0.1", 0)):
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.target = target
        self.delay_s = delay_ms / 1e3
        self.listen = listen
        self.address: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        if self.address is None:
            raise RuntimeError("the proxy is not started")
        return f"http://{self.address[0]}:{self.address[1]}"

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(_pipe(c_reader, t_writer, self.delay_s), _pipe(t_reader, c_writer, self.delay_s))
        except asyncio.CancelledError:  # stop(): the connection closes with the proxy
            pass

    def start(self) -> tuple[str, int]:
        """Listen and serve on a daemon thread; the bound ``(host, port)``."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, *self.listen))
                self.address = self._server.sockets[0].getsockname()[:2]
            except BaseException as exc:
                failed.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"delay-proxy-{self.target[1]}", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self.address

    def stop(self) -> None:
        """Close the listener and every open connection (idempotent)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            self._server.close()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(timeout=5)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ggufswarm.netdelay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward them to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way latency added to each direction (ms)")
    args = parser.parse_args(argv)
    proxy = DelayProxy(args.target, args.delay_ms, args.listen)
    host, port = proxy.start()
    print(f"delaying {host}:{port} -> {args.target[0]}:{args.target[1]} by {args.delay_ms} ms each way", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
