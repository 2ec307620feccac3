"""Temporary: the sharding helpers moved to muloco/sharding.py (below every package that shares them).
Kept only for the imports in sync/engine.py and run/build.py until they import muloco.sharding; then delete.
"""

from muloco.sharding import local, shard_model, worker_mesh

__all__ = ["local", "shard_model", "worker_mesh"]
