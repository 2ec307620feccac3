"""muloco/allocator.py: glibc keeps freed memory for reuse in a training process; MULOCO_MALLOC=system
leaves the allocator alone."""

import os
import platform
import subprocess
import sys

import pytest

CHECK = "from muloco.allocator import keep_freed_memory; print(keep_freed_memory(), keep_freed_memory())"


def run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MULOCO_MALLOC"}
    if env_value is not None:
        env["MULOCO_MALLOC"] = env_value
    return subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60
    ).stdout


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_keeps_freed_memory_once_per_process():
    assert run(None).split() == ["True", "True"]


def test_system_leaves_the_allocator_alone():
    assert run("system").split() == ["False", "False"]
