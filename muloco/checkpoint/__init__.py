"""Checkpoints, written atomically and checked when read.

plain.py    one file per step (torch.save): write to a temporary file, fsync, rename; keep the newest N
sharded.py  sharding: fsdp, a torch.distributed.checkpoint (DCP) directory of every rank's shards
"""
