"""One rank of tests/comm/test_gather_bytes.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): prints
the bounded and the sized all-gather's results, and whether an oversized payload was refused."""

import json
import sys

from muloco.comm.torch_dist import TorchDistBackend

PAYLOADS = [b"", b"a" * 7, bytes(range(256)) * 3]  # rank r's: empty, short, the longest (768 bytes)

backend = TorchDistBackend(timeout_s=60)
mine = PAYLOADS[backend.rank]
bounded = backend.all_gather_bytes(mine, capacity=768).wait()
sized = backend.all_gather_bytes(mine).wait()
refused = None
if backend.rank == 2:  # checked before anything is sent: no other rank waits for it
    try:
        backend.all_gather_bytes(mine, capacity=10)
    except RuntimeError as exc:
        refused = str(exc)
backend.barrier()
print(json.dumps({"ok": bounded == sized == PAYLOADS, "refused": refused}))
backend.close()
sys.exit(0)
