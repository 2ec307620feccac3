"""Inner optimizers: Muon and its Newton-Schulz maths, parameter routing, the factory the trainer calls.

    newton_schulz.py  pure functions: coefficient sets (keller, muloco, polar_express), normalization,
                      the standard and Gram Newton-Schulz iterations, the CPU/GPU dtype choice
    muon.py           `muon_update` and `adjusted_lr` (pure), and the thin `Muon` optimizer class
    distributed_muon.py
                      `DistributedMuon`: Muon split across a worker's ranks, one owner rank per matrix,
                      owners balanced by estimated NS cost (`assign_owners`)
    sharded_muon.py   `ShardedMuon`: Muon on FSDP2 (DTensor) parameters, each matrix gathered to its owner
                      rank for NS and its rows scattered back (sharding=fsdp)
    routing.py        which parameters go to Muon and which to AdamW (roles + regex overrides)
    catalogue.py      any other inner.optimizer: a torch.optim class, a pytorch-optimizer name or
                      module:Class, resolved and its kwargs checked when the config loads
    factory.py        `build_inner_optimizer(model, inner, process_group=None, sharded=False)` ->
                      `InnerOptimizer` for inner.optimizer = muon | adamw | sgd | torch_muon | any other

docs/optimizers.md describes the options and where we differ from torch.optim.Muon.
"""

from muloco.optim.distributed_muon import DistributedMuon, assign_owners
from muloco.optim.factory import InnerOptimizer, build_inner_optimizer
from muloco.optim.muon import Muon, adjusted_lr, muon_update
from muloco.optim.newton_schulz import COEFFICIENT_SETS, newton_schulz
from muloco.optim.routing import muon_param_groups, routing_table


def __getattr__(name: str):
    # ShardedMuon imports DTensor (~0.7 s of CPU): only where a sharded worker needs it.
    if name == "ShardedMuon":
        from muloco.optim.sharded_muon import ShardedMuon

        return ShardedMuon
    raise AttributeError(f"module 'muloco.optim' has no attribute {name!r}")


__all__ = [
    "COEFFICIENT_SETS",
    "DistributedMuon",
    "InnerOptimizer",
    "Muon",
    "ShardedMuon",
    "adjusted_lr",
    "assign_owners",
    "build_inner_optimizer",
    "muon_param_groups",
    "muon_update",
    "newton_schulz",
    "routing_table",
]
