"""Processes and links: starting local runs and modelling a WAN link.

wan.py             the WAN model (links, collective times, transports, a measured run's workload) and
                   `muloco plan`'s planner
launch.py          `muloco launch --nproc N`: local processes for the torch, hivemind or torchft backends
preloaded.py       `muloco train` processes forked from a server that imported torch and muloco once
preload_server.py  that server, and the set-up of each child it forks
parent_death.py    a child asked to end when its parent dies (imports nothing of muloco)

The emulated WAN (network namespaces, rate-limited links) that benchmarks and tests run over is
muloco/testbed/, outside the product.
"""
