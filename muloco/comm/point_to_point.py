"""Messages between two processes of a torch.distributed run, on a gloo group of their own: the asynchronous
outer updates' workers and their parameter owner (sync/param_owner.py) talk here, one pair at a time, while
the main threads' collectives run on the world group (two groups never share a connection, so the owner's
thread and rank 0's training loop do not interleave their traffic).

A message is a header of HEADER_LENGTH float64 numbers, then, when the header's first number is not 0, a
payload of that many bytes (two sends with their own tags: a receiver from any rank learns the sender
from the header, then takes the payload from that sender alone).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

HEADER_LENGTH = 8
_HEADER_TAG, _PAYLOAD_TAG = 17, 18


class PointToPoint:
    def __init__(self, timeout_s: float) -> None:
        """A collective of every rank (torch.distributed's new_group): call it at the same point on all."""
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def send(self, dst: int, header: list[float], payload: bytes = b"") -> None:
        """header: up to HEADER_LENGTH - 1 numbers (the payload's length goes first)."""
        if len(header) >= HEADER_LENGTH:
            raise ValueError(f"a header of {len(header)} numbers: at most {HEADER_LENGTH - 1}")
        numbers = [float(len(payload)), *header] + [0.0] * (HEADER_LENGTH - 1 - len(header))
        dist.send(torch.tensor(numbers, dtype=torch.float64), dst, group=self.group, tag=_HEADER_TAG)
        if payload:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.send(buffer, dst, group=self.group, tag=_PAYLOAD_TAG)

    def receive(self, src: int | None = None) -> tuple[int, list[float], bytes]:
        """The next message from `src` (None: from any rank): (its sender, its header, its payload)."""
        header = torch.zeros(HEADER_LENGTH, dtype=torch.float64)
        sender = dist.recv(header, src, group=self.group, tag=_HEADER_TAG)
        length = int(header[0])
        payload = b""
        if length:
            buffer = torch.empty(length, dtype=torch.uint8)
            dist.recv(buffer, sender, group=self.group, tag=_PAYLOAD_TAG)
            payload = buffer.numpy().tobytes()
        return sender, header[1:].tolist(), payload
