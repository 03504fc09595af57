"""A TCP relay that makes a link slow and lossy in user space (tests/netns.py, no sch_netem).

    python -m tests.netrelay --listen 10.231.1.1:7001 --to 127.0.0.1:7000 --delay-ms 100 --loss 0.05

Each direction of each connection is a FIFO: a chunk read at time t is written at
t + delay_ms (one way, so the round trip grows by 2 x delay_ms), never before the chunk ahead of
it. With probability `loss` a chunk is held one retransmission timeout longer
(`RTO_MS` + 2 x delay_ms, Linux's minimum RTO plus a round trip): the head-of-line stall a lost
TCP segment costs the application. Bytes are never dropped or reordered; TCP would not let them be.
"""

from __future__ import annotations

import argparse
import asyncio
import random
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
