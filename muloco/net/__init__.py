"""Processes and links: starting local runs, emulating a WAN, and modelling one.

wan.py      the WAN model (links, collective times, transports) and `muloco plan`'s planner
launch.py   `muloco launch --nproc N`: local processes for the torch, hivemind or torchft backends
testbed.py  emulated hosts: network namespaces with rate-limited links (root), for benchmarks
"""
