"""The WAN testbed: emulated hosts and links on one Linux machine, for benchmarks and tests (root).

Not part of the product: nothing else in muloco imports it; it imports the product (muloco.net's launch
and parent-death helpers, and its preloaded processes, which enter a namespace: `start_muloco(netns=...)`).

network.py     a `Testbed`: a network namespace per host on one hub, tc tbf rate limits, a one-way delay,
               teardown on exit, Ctrl+C, SIGTERM (and after a SIGKILL by the next testbed); processes on hosts
delay_line.py  the hub's switch when links have latency: a user-space relay that holds each frame
               (`python -m muloco.testbed.delay_line`, started by network.py)
train.py       `train_on_testbed`: `muloco train` on every host, one worker each (torch, hivemind, torchft)
probe.py       what links carry, measured between hosts: round trips, TCP goodput, gloo collectives' times
"""
