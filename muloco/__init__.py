"""muloco: low-communication distributed training of language models (DiLoCo, MuLoCo).

Map of the package, top to bottom (imports point down only: pyproject.toml's import-linter contracts, run in
CI; docs/design.md draws it):
    cli/ (the commands) -> sweep/ -> tools/ (read finished runs) | net/launch.py, net/preloaded.py (processes)
    diloco.py (DiLoCo, the Python API) -> run/ (trainer.py: the loop) -> sync/ (the engine)
    -> net/wan.py (the link model) -> comm/ (backends) -> compress/ | optim/ | data/ -> models/
    -> checkpoint/ -> sharding.py -> config/ (the schema) -> errors.py, version.py, net/parent_death.py
    testbed/ (emulated WAN hosts for benchmarks and tests) sits outside: it imports muloco, never the reverse
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from muloco.version import __version__

# Bit-for-bit resumes and reruns on every x86-64 CPU: without it MKL's GEMM may give results that depend on
# its operands' memory alignment (Intel's "Conditional Numerical Reproducibility"), so a resumed process,
# whose allocations differ, can drift by an ulp from the uninterrupted one (seen on AVX-512: PowerSGD's
# resume over 2 processes). MKL reads it when it first runs, after this import; a user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

if TYPE_CHECKING:
    from muloco.config import Config
    from muloco.diloco import DiLoCo
    from muloco.optim import Muon
    from muloco.optim.check import load_run_config as load_config


def __getattr__(name: str):
    # Lazy exports keep `import muloco` (and the CLI's start) fast.
    if name == "Config":
        from muloco.config import Config

        return Config
    if name == "load_config":  # the schema's load_config and the inner optimizer's check (optim/check.py)
        from muloco.optim.check import load_run_config

        return load_run_config
    if name == "DiLoCo":
        from muloco.diloco import DiLoCo

        return DiLoCo
    if name == "Muon":
        from muloco.optim import Muon

        return Muon
    raise AttributeError(f"module 'muloco' has no attribute {name!r}")


__all__ = ["Config", "DiLoCo", "Muon", "__version__", "load_config"]
