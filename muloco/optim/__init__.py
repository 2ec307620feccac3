"""Inner optimizers: Muon and its Newton-Schulz maths, parameter routing, the factory the trainer calls.

    orthogonalize.py  pure functions: coefficient sets (keller, muloco, polar_express), normalization,
                      the standard and Gram Newton-Schulz iterations, the CPU/GPU dtype choice
    muon.py           `muon_update` and `adjusted_lr` (pure), and the thin `Muon` optimizer class
    distributed_muon.py
                      `DistributedMuon`: Muon split across a worker's ranks, one owner rank per matrix,
                      owners balanced by estimated NS cost (`assign_owners`)
    sharded_muon.py   `ShardedMuon`: Muon on FSDP2 (DTensor) parameters, each matrix gathered to its owner
                      rank for NS and its rows scattered back (sharding=fsdp)
    routing.py        which parameters go to Muon and which to AdamW (roles + regex overrides)
    catalogue.py      any other inner.optimizer: a torch.optim class, a pytorch-optimizer name or
                      module:Class, resolved, its kwargs checked, a trial step taken
    check.py          `check_inner_optimizer(cfg)`: the inner optimizer a config names, checked where a
                      config is loaded for a run (the schema in muloco/config/ knows no optimizer)
    factory.py        `build_inner_optimizer(model, inner, process_group=None, sharded=False)` ->
                      `InnerOptimizer` for inner.optimizer = muon | adamw | sgd | torch_muon | any other

docs/optimizers.md describes the options and where we differ from torch.optim.Muon.

Names load lazily: `muloco.optim.check` (the CLI's config check) must not import torch for a built-in name.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from muloco.optim.check import check_inner_optimizer
    from muloco.optim.distributed_muon import DistributedMuon, assign_owners
    from muloco.optim.factory import InnerOptimizer, build_inner_optimizer
    from muloco.optim.muon import Muon, adjusted_lr, muon_update
    from muloco.optim.orthogonalize import COEFFICIENT_SETS, newton_schulz
    from muloco.optim.routing import muon_param_groups, routing_table
    from muloco.optim.sharded_muon import ShardedMuon

# Public name -> the module that defines it. ShardedMuon imports DTensor (~0.7 s of CPU): only where a
# sharded worker asks for it.
_EXPORTS = {
    "COEFFICIENT_SETS": "orthogonalize",
    "DistributedMuon": "distributed_muon",
    "InnerOptimizer": "factory",
    "Muon": "muon",
    "ShardedMuon": "sharded_muon",
    "adjusted_lr": "muon",
    "assign_owners": "distributed_muon",
    "build_inner_optimizer": "factory",
    "check_inner_optimizer": "check",
    "muon_param_groups": "routing",
    "muon_update": "muon",
    "newton_schulz": "orthogonalize",
    "routing_table": "routing",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'muloco.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"muloco.optim.{module}"), name)


__all__ = [
    "COEFFICIENT_SETS",
    "DistributedMuon",
    "InnerOptimizer",
    "Muon",
    "ShardedMuon",
    "adjusted_lr",
    "assign_owners",
    "build_inner_optimizer",
    "check_inner_optimizer",
    "muon_param_groups",
    "muon_update",
    "newton_schulz",
    "routing_table",
]
