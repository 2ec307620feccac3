"""One peer of a loopback hivemind swarm training a small MLP with `muloco.DiLoCo` (the Python API).

    python diloco_peer.py PEER_INDEX INITIAL_PEERS_JSON OUT_JSON

Peer 0 starts the swarm (INITIAL_PEERS_JSON = "[]") and logs its multiaddrs; the others join it. Each peer
trains on its own data (seeded by its index) and writes its final global parameters' hash to OUT_JSON.
"""

import hashlib
import json
import logging
import sys

import torch

import muloco
from muloco.config import HivemindBackendConfig

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
index, initial_peers, out = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial model on every peer
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
swarm = HivemindBackendConfig(
    run_id="diloco_api", initial_peers=initial_peers, wait_for_peers=2, target_group_size=2, join_timeout_s=60
)
diloco = muloco.DiLoCo(model, inner, sync_every=5, outer_lr=0.7, outer_momentum=0.6, backend=swarm)
data = torch.Generator().manual_seed(100 + index)  # each peer its own data
w_true = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
group_sizes = []
for _ in range(15):
    x = torch.randn(16, 8, generator=data)
    loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
    loss.backward()
    inner.step()
    inner.zero_grad()
    if diloco.step(loss):
        group_sizes += [r.fields.get("group_size") for r in diloco.records]
digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in diloco.global_params)).hexdigest()
diloco.close()
with open(out, "w") as f:
    json.dump({"sha256": digest, "outer_steps": diloco.outer_steps, "group_sizes": group_sizes}, f)
