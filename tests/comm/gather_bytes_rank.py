"""One rank of tests/comm/test_gather_bytes.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): prints
whether the bounded and the sized all-gather and all-to-all returned every payload in rank order, and
whether an oversized payload was refused."""

import json
import sys

from muloco.comm.torch_dist import TorchDistBackend

PAYLOADS = [b"", b"a" * 7, bytes(range(256)) * 3]  # rank r's: empty, short, the longest (768 bytes)

backend = TorchDistBackend(timeout_s=60)
mine = PAYLOADS[backend.rank]
bounded = backend.all_gather_bytes(mine, capacity=768).wait()
sized = backend.all_gather_bytes(mine).wait()
# Rank r sends rank q r + 2 q bytes of value 10 r + q (rank 0 sends itself nothing); rank q's bound: the
# most any rank sends it.
sent = [bytes([10 * backend.rank + q]) * (backend.rank + 2 * q) for q in range(3)]
to_me = [bytes([10 * r + backend.rank]) * (r + 2 * backend.rank) for r in range(3)]
bounded_a2a = backend.all_to_all_bytes(sent, capacities=[2 + 2 * q for q in range(3)]).wait()
sized_a2a = backend.all_to_all_bytes(sent).wait()
refused = None
if backend.rank == 2:  # checked before anything is sent: no other rank waits for it
    try:
        backend.all_gather_bytes(mine, capacity=10)
    except RuntimeError as exc:
        refused = str(exc)
backend.barrier()
ok = bounded == sized == PAYLOADS and bounded_a2a == sized_a2a == to_me
print(json.dumps({"ok": ok, "refused": refused}))
backend.close()
sys.exit(0)
