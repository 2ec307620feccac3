"""Each testbed host's own absolute share of the CPU (issue 62: hosts of unequal compute): a cgroup v1 `cpu`
controller group per host whose CFS quota caps its processes at `cores` CPUs, whatever the others leave
idle, so that a slow host's idle share never speeds up the rest (4 hosts may share 2 cores).

A process started on a host is moved into the host's group at once (its threads with it; the processes it
starts later inherit the group). The groups are removed with the testbed, and those of a testbed whose
process died (SIGKILL) by the next one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000  # the CFS period: a quota of q cores is q x 100 ms of CPU every 100 ms
MIN_QUOTA_US = 1_000  # the kernel's floor


def missing_cpu_controller() -> str | None:
    """Why per-host CPU quotas cannot be set here, or None."""
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}"
    if not os.access(CPU_CGROUP, os.W_OK):
        return f"{CPU_CGROUP} is not writable (run as root)"
    return None


class CpuQuotas:
    def __init__(self, name: str, cores: list[float]) -> None:
        """name: the testbed's (its groups are <name>-h<i>); cores: host i's CPU quota, in cores."""
        if any(c <= 0 for c in cores):
            raise ValueError(f"testbed cpu quotas must be > 0 cores, got {cores}")
        self.groups = [CPU_CGROUP / f"{name}-h{i}" for i in range(len(cores))]
        self.cores = cores

    def create(self) -> None:
        for group, cores in zip(self.groups, self.cores, strict=True):
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US, round(cores * PERIOD_US))))

    def confine(self, host: int, pid: int) -> None:
        """Move process `pid` (all its threads) into host `host`'s group."""
        (self.groups[host] / "cgroup.procs").write_text(str(pid))

    def throttled_s(self, host: int) -> float:
        """Seconds host `host`'s processes were held back by its quota so far."""
        stat = dict(line.split() for line in (self.groups[host] / "cpu.stat").read_text().splitlines())
        return int(stat.get("throttled_time", 0)) / 1e9

    def remove(self, timeout_s: float = 10.0) -> list[str]:
        """Remove the groups (once their processes have exited); the ones that would not go, by name."""
        return [group.name for group in self.groups if not remove_group(group, timeout_s)]


def remove_group(group: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group.exists():
        try:
            group.rmdir()  # a cgroup directory goes with rmdir once it holds no process
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    return True


def remove_stale_groups(prefix: str, alive) -> list[str]:
    """The groups of testbeds (named <prefix><pid>-...) whose process no longer exists, removed."""
    if not CPU_CGROUP.exists():
        return []
    removed = []
    for group in CPU_CGROUP.glob(f"{prefix}*"):
        pid = group.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)) and remove_group(group, 1.0):
            removed.append(group.name)
    return removed
