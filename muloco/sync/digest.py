"""Temporary: state_digest moved to muloco/comm/digest.py (below the engine: the swarm's and torchft's state
transfers check it). Kept only for the imports in sync/elastic.py and sync/swarm.py until they import
muloco.comm.digest; then delete."""

from muloco.comm.digest import state_digest

__all__ = ["state_digest"]
