"""A user-space delay line: the testbed hub's switch when its links have latency.

This kernel has no `netem`, the qdisc that delays packets; tbf, htb and pfifo only queue them. So the hub
forwards frames itself: one AF_PACKET socket per hub port (p0, p1, ...; no bridge), every frame received
on a port is held for the one-way delay and then sent out of the port its destination MAC was learned on
(broadcast, multicast and unknown destinations to every other port), as a learning switch does. A frame
crosses the hub once between two hosts, so the one-way delay between them is `delay_ms` and the round trip
twice that. The rate stays with tbf: on each host's eth0 (its upload) and on the hub's ports (its
download), which the frames sent here pass through.

Offloads stay on: with PACKET_VNET_HDR the sockets read a veth's GSO frames whole (up to 64 KB, with the
virtio-net header that says how to segment and checksum them) and hand them back the same way, so the
relay moves a few thousand frames a second at hundreds of Mbit/s rather than one per 1,500 bytes.

    python -m muloco.testbed.delay_line --delay-ms 25 p0 p1 p2 p3     # inside the hub's namespace (root)
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import time
from collections import deque

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15  # <linux/if_packet.h>
PACKET_OUTGOING = 4  # sll_pkttype of a frame this host sent: not one to forward
VNET_HDR_BYTES = 10  # struct virtio_net_hdr
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # <asm-generic/socket.h>; root may pass net.core.*mem_max
FRAME_BYTES = 256 * 1024  # a GSO frame (<= 64 KB) and its header, with room to spare
SOCKET_BUFFER_BYTES = 16 * 1024 * 1024  # frames waiting for the relay's loop, not dropped by the kernel
READY = "delay line ready"


def open_port(name: str) -> socket.socket:
    """A raw socket on hub port `name`: every frame it receives, with its virtio-net header."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    for option in (SO_RCVBUFFORCE, SO_SNDBUFFORCE):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    sock.bind((name, ETH_P_ALL))
    sock.setblocking(False)
    return sock


class DelayLine:
    """Frames in, held `delay_s`, frames out, in arrival order (a constant delay keeps the queue sorted)."""

    def __init__(self, ports: list[str], delay_s: float) -> None:
        self.sockets = [open_port(name) for name in ports]
        self.delay_s = delay_s
        self.held: deque[tuple[float, int, bytes]] = deque()  # (due, port received on, frame)
        self.port_of: dict[bytes, int] = {}  # learned: source MAC -> port
        self.forwarded = self.dropped = 0

    def receive(self, port: int, now: float) -> None:
        sock = self.sockets[port]
        while True:
            try:
                frame, address = sock.recvfrom(FRAME_BYTES)
            except BlockingIOError:
                return
            if address[2] == PACKET_OUTGOING:  # what this relay itself sent out of the port
                continue
            self.port_of[frame[VNET_HDR_BYTES + 6 : VNET_HDR_BYTES + 12]] = port
            self.held.append((now + self.delay_s, port, frame))

    def release(self, now: float) -> None:
        while self.held and self.held[0][0] <= now:
            _, source, frame = self.held.popleft()
            destination = frame[VNET_HDR_BYTES : VNET_HDR_BYTES + 6]
            port = self.port_of.get(destination)
            if port is None or destination[0] & 1:  # unknown, broadcast or multicast: every other port
                targets = [p for p in range(len(self.sockets)) if p != source]
            else:
                targets = [port] if port != source else []
            for target in targets:
                try:
                    self.sockets[target].send(frame)
                    self.forwarded += 1
                except OSError:  # the port's tbf queue is full: dropped, as a switch's full queue drops
                    self.dropped += 1

    def run(self, stop_after_s: float | None = None) -> None:
        poller = select.poll()
        port_of_fd = {}
        for port, sock in enumerate(self.sockets):
            poller.register(sock, select.POLLIN)
            port_of_fd[sock.fileno()] = port
        end = None if stop_after_s is None else time.monotonic() + stop_after_s
        while end is None or time.monotonic() < end:
            wait_s = self.held[0][0] - time.monotonic() if self.held else 1.0
            for fd, _ in poller.poll(max(0.0, wait_s) * 1000.0):
                self.receive(port_of_fd[fd], time.monotonic())
            self.release(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    summary = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m muloco.testbed.delay_line", description=summary)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay through the hub")
    parser.add_argument("ports", nargs="+", help="the hub's ports (p0 p1 ...)")
    args = parser.parse_args(argv)
    line = DelayLine(args.ports, args.delay_ms / 1000.0)
    print(f"{READY}: {len(args.ports)} ports, {args.delay_ms:g} ms one way", flush=True)
    try:
        line.run()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
