"""Replica streams: each of the K replicas reads its own deterministic, disjoint sequence of training chunks.

The train tokens are cut into N = len // (seq_len + 1) non-overlapping chunks of seq_len + 1 tokens (x and
the one-token-shifted y come from the same chunk). Epoch e visits the chunks in the order perm_e, a
torch.randperm seeded by a sha256 of (seed, e). The samples of all replicas interleave into one global
sequence: replica r's i-th sample is global index g = i*K + r, which is chunk perm_e[g % N] of epoch
e = g // N. So within an epoch no two replicas ever share a chunk, every chunk is used once per epoch when
the replicas advance together, and a replica's stream depends only on (tokens, seq_len, seed, r, K), not on
how the replicas are placed on processes (docs/design.md: a K=4 simulation equals 4 real processes).

Resuming: `state_dict()` holds the position (samples consumed), and a stream rebuilt with the same arguments
and `load_state_dict(...)` yields exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit torch seed for (seed, epoch); sha256, so it is the same in every process and Python."""
    digest = hashlib.sha256(f"muloco.data.stream:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def epoch_permutation(num_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """perm_e: the order in which epoch e visits the chunks (int64, a permutation of range(num_chunks))."""
    gen = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_chunks, generator=gen).numpy()


def gather_chunks(tokens: np.ndarray, chunks: np.ndarray, chunk_len: int) -> np.ndarray:
    """Rows tokens[c*chunk_len : (c+1)*chunk_len] for each c in chunks, in that order: (n, chunk_len).

    Rows are read in ascending offset order (kinder to a memmap's page cache) and put back in sample order.
    """
    order = np.argsort(chunks, kind="stable")
    starts = chunks[order].astype(np.int64) * chunk_len
    rows = np.empty((len(chunks), chunk_len), dtype=tokens.dtype)
    rows[order] = tokens[starts[:, None] + np.arange(chunk_len)]  # (n, chunk_len) fancy index
    return rows


def _to_xy(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, seq_len + 1) token rows -> x, y int64 tensors of shape (n, seq_len), y = x shifted by one."""
    rows = torch.from_numpy(rows.astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class ReplicaStream:
    """Replica r of K's training batches: deterministic, disjoint from the other replicas, resumable."""

    def __init__(self, tokens: np.ndarray, seq_len: int, replica: int, num_replicas: int, seed: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if num_replicas <= 0 or not 0 <= replica < num_replicas:
            raise ValueError(f"replica must be in [0, num_replicas), got {replica=} {num_replicas=}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.replica = replica
        self.num_replicas = num_replicas
        self.seed = seed
        self.num_chunks = len(tokens) // (seq_len + 1)  # N
        if self.num_chunks == 0:
            raise ValueError(
                f"{len(tokens)} train tokens hold no sequence of seq_len + 1 = {seq_len + 1} tokens"
            )
        self._position = 0  # samples this replica has consumed (i)
        self._perms: dict[int, np.ndarray] = {}  # epoch -> perm_e; at most the two a batch can touch

    @property
    def position(self) -> int:
        """Samples (sequences) consumed so far by this replica."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch of the next sample."""
        return (self._position * self.num_replicas + self.replica) // self.num_chunks

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if abs(e - epoch) <= 1}
            self._perms[epoch] = epoch_permutation(self.num_chunks, self.seed, epoch)
        return self._perms[epoch]

    def chunk_ids(self, start: int, n: int) -> np.ndarray:
        """The chunk indices of this replica's samples start .. start + n - 1 (pure; no position change)."""
        g = (start + np.arange(n, dtype=np.int64)) * self.num_replicas + self.replica  # global sample index
        epochs, slots = np.divmod(g, self.num_chunks)
        chunks = np.empty(n, dtype=np.int64)
        for e in np.unique(epochs):  # one or two epochs unless a batch is larger than the data
            mask = epochs == e
            chunks[mask] = self._perm(int(e))[slots[mask]]
        return chunks

    def next_batch(self, n_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next n_seqs samples: int64 CPU tensors x, y of shape (n_seqs, seq_len), y = x shifted."""
        if n_seqs <= 0:
            raise ValueError(f"n_seqs must be positive, got {n_seqs}")
        chunks = self.chunk_ids(self._position, n_seqs)
        self._position += n_seqs
        return _to_xy(gather_chunks(self.tokens, chunks, self.seq_len + 1))

    def state_dict(self) -> dict[str, int]:
        return {
            "position": self._position,
            "replica": self.replica,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_chunks": self.num_chunks,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at state["position"]; the other fields must match this stream (same data and layout)."""
        mine = self.state_dict()
        for key in ("replica", "num_replicas", "seed", "seq_len", "num_chunks"):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"data stream state has {key}={state[key]} but this stream has {key}={mine[key]}; "
                    "resume with the same workers, run.seed, model.seq_len and data"
                )
        position = int(state["position"])
        if position < 0:
            raise ValueError(f"data stream state has a negative position ({position})")
        self._position = position


def val_batches(
    val_tokens: np.ndarray, seq_len: int, eval_tokens: int, batch_seqs: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: ceil(eval_tokens / seq_len) chunks spread evenly over the val split.

    The val split is cut into M = len // (seq_len + 1) chunks; chunk floor(j * M / n) is taken for
    j = 0 .. n-1 (n capped at M), so the set covers the whole split rather than its first file. Returned as
    (x, y) batches of at most batch_seqs sequences, the same for every call, replica and process.
    """
    if min(seq_len, eval_tokens, batch_seqs) <= 0:
        raise ValueError(
            f"seq_len, eval_tokens and batch_seqs must be positive: {seq_len=} {eval_tokens=} {batch_seqs=}"
        )
    num_chunks = len(val_tokens) // (seq_len + 1)
    if num_chunks == 0:
        raise ValueError(
            f"{len(val_tokens)} val tokens hold no sequence of seq_len + 1 = {seq_len + 1} tokens"
        )
    n = min(math.ceil(eval_tokens / seq_len), num_chunks)
    chunks = np.arange(n, dtype=np.int64) * num_chunks // n  # distinct since n <= num_chunks
    rows = gather_chunks(val_tokens, chunks, seq_len + 1)
    return [_to_xy(rows[i : i + batch_seqs]) for i in range(0, n, batch_seqs)]
