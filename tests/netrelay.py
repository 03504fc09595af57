"""A TCP relay that makes a link slow and lossy in user space (tests/netns.py, no sch_netem).

    python -m tests.netrelay --listen 10.231.1.1:7001 --to 127.0.0.1:7000 --delay-ms 100 --loss 0.05

Each direction of each connection is a FIFO: a chunk read at time t is written at
t + delay_ms (one way, so the round trip grows by 2 x delay_ms), never before the chunk ahead of
it. With probability `loss` a chunk is held one retransmission timeout longer
(`RTO_MS` + 2 x delay_ms, Linux's minimum RTO plus a round trip): the head-of-line stall a lost
TCP segment costs the application. Bytes are never dropped or reordered; TCP would not let them be.

In a test, :class:`Relay` runs the same relay on a thread of the test process and can also fail
the link the way a server outage does: `cut()` resets every open connection and refuses new
ones (a connection is accepted and reset at once, as a stopped server's port would), `restore()`
lets connections through again, `drop_connections()` resets the open ones only (a server
restart: every client must reconnect).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import struct
import threading
import time

RTO_MS = 200.0  # Linux's TCP_RTO_MIN
CHUNK = 64 * 1024


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, loss: float
) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(CHUNK):
            due = time.monotonic() + delay_s
            if random.random() < loss:
                due += RTO_MS / 1000 + 2 * delay_s
            await queue.put((due, data))
        await queue.put((0.0, b""))

    async def write() -> None:
        last_due = 0.0
        while True:
            due, data = await queue.get()
            if not data:
                break
            last_due = max(last_due, due)  # in order: never before the chunk ahead
            await asyncio.sleep(max(0.0, last_due - time.monotonic()))
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(listen: str, to: str, delay_ms: float, loss: float) -> None:
    host, port = listen.rsplit(":", 1)
    to_host, to_port = to.rsplit(":", 1)
    delay_s = delay_ms / 1000

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pump(reader, up_writer, delay_s, loss), _pump(up_reader, writer, delay_s, loss)
        )

    server = await asyncio.start_server(on_client, host, int(port))
    async with server:
        await server.serve_forever()


class Relay:
    """A relay to `to` (``HOST:PORT``) on a free port of 127.0.0.1, run by a daemon thread.

    ``Relay(to).start()`` returns the ``HOST:PORT`` to connect to; `stop()` closes everything.
    `connections` is the number of open relayed connections.
    """

    def __init__(self, to: str, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        self.to_host, to_port = to.rsplit(":", 1)
        self.to_port = int(to_port)
        self.delay_s, self.loss = delay_ms / 1000, loss
        self._open: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self.address = ""

    @property
    def connections(self) -> int:
        return len(self._open) // 2

    def start(self) -> str:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._on_client, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    def cut(self) -> None:
        """Reset every open connection and refuse new ones until `restore()`."""
        self._cut = True
        self.drop_connections()

    def restore(self) -> None:
        self._cut = False

    def drop_connections(self) -> None:
        """Reset every open connection (RST), as a restarting server does."""

        async def drop() -> None:
            for writer in list(self._open):
                _reset(writer)

        self._call(drop())

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.to_host, self.to_port)
        except OSError:
            _reset(writer)
            return
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(
                _pump(reader, up_writer, self.delay_s, self.loss),
                _pump(up_reader, writer, self.delay_s, self.loss),
            )
        finally:
            self._open -= {writer, up_writer}
            for w in (writer, up_writer):
                _reset(w)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), the way a killed peer's socket closes."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--to", required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (ms)")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of chunks stalled")
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.to, args.delay_ms, args.loss))


if __name__ == "__main__":
    main()
