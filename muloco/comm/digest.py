"""The digest of a model state: two workers hold the same state exactly when their digests agree. Used by
swarm peers to compare states, and to check a state that came over the network (hivemind and torchft
state transfers) before it is adopted."""

from __future__ import annotations

import hashlib

import torch


def state_digest(tensors: list[torch.Tensor]) -> bytes:
    """A 16-byte hash of the tensors' values, dtypes and shapes, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return digest.digest()
