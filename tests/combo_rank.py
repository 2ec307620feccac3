"""One rank of a set of processes that runs every case of a plan in turn as `muloco train`, in this one
interpreter, so torch, hivemind and torchft are imported once per rank rather than once per case
(test_helpers.run_combo_ranks: the combination tests, and the equality tests of test_torch_dist,
test_torchft, test_topology and test_sharded). Each case is wired as `muloco launch --backend B` wires
its processes:

- torch: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a port per case, chosen by the test);
- hivemind: rank 0 starts the case's swarm and writes the multiaddrs it logs ("join with
  backend.hivemind.initial_peers=[...]") to the rendezvous folder; the other ranks join them;
- torchft: rank 0 starts the case's lighthouse (in this process) and writes its address there.

A case with an "api" entry trains through `muloco.DiLoCo` instead (a user's own loop; a built-in GPT on
random tokens): over the torch backend (TorchDistBackend) or a hivemind swarm (HivemindBackendConfig).

Usage: python combo_rank.py BACKEND RANK WORLD PLAN.json RENDEZVOUS_DIR. Each case's exit code goes to
RENDEZVOUS_DIR/<case>.rank<RANK>.rc. Every wait here is bounded (WAIT_S), so a rank never hangs.
"""

from __future__ import annotations

import ast
import faulthandler
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

WAIT_S = 120.0
MADDRS = re.compile(r"join with backend\.hivemind\.initial_peers=(\[.*\])")


FAILED = "failed before it started"  # what rank 0 writes instead of an address when its case failed


def wait_for_file(path: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s")
        time.sleep(0.05)
    time.sleep(0.05)  # written with one write_text: let it land whole
    text = path.read_text()
    if text == FAILED:  # fail fast: rank 0's case failed, no swarm or lighthouse will come
        raise RuntimeError(f"rank 0 {FAILED} ({path.name})")
    return text


class MaddrsToFile(logging.Handler):
    """Writes the swarm's multiaddrs to `path` when this peer logs them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        found = MADDRS.search(record.getMessage())
        if found:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps([str(m) for m in ast.literal_eval(found.group(1))]))
            tmp.rename(self.path)


def wiring(backend: str, rank: int, world: int, case: dict, rendezvous: Path) -> tuple[list[str], object]:
    """The case's backend overrides, and what to close after it (a lighthouse, a log handler)."""
    name = case["name"]
    if backend == "torch":
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(case["port"]),
        )
        return ["backend.kind=torch", f"run.name={name}"], None
    if backend == "hivemind":
        extra = [
            "backend.kind=hivemind",
            f"run.name={name}-peer{rank}",
            f"backend.hivemind.peer_index={rank}",
            f"backend.hivemind.wait_for_peers={world}",
        ]
        maddrs_file = rendezvous / f"{name}.maddrs"
        if rank == 0:
            handler = MaddrsToFile(maddrs_file)
            logging.getLogger().addHandler(handler)
            return extra, handler
        return [*extra, f"backend.hivemind.initial_peers={wait_for_file(maddrs_file)}"], None
    assert backend == "torchft", f"{backend=}"
    address_file = rendezvous / f"{name}.lighthouse"
    lighthouse = None
    if rank == 0:
        from muloco.config import TorchftBackendConfig
        from muloco.net.launch import start_lighthouse

        lighthouse, address = start_lighthouse(TorchftBackendConfig())
        address_file.write_text(address)
    else:
        address = wait_for_file(address_file)
    extra = [
        "backend.kind=torchft",
        f"run.name={name}-worker{rank}",
        f"backend.torchft.lighthouse={address}",
        f"backend.torchft.replica_id={rank}",
        "backend.torchft.hostname=127.0.0.1",
        f"backend.torchft.wait_for_workers={world}",
    ]
    return extra, lighthouse


def train_with_the_api(backend: str, rank: int, world: int, case: dict, rendezvous: Path) -> int:
    """A few syncs of `muloco.DiLoCo` at its defaults but for the case's compression and fragments;
    writes the final global parameters' hash to <case>.rank<RANK>.json."""
    import hashlib

    import torch

    import muloco
    from muloco.comm.torch_dist import TorchDistBackend
    from muloco.config import CompressionConfig, HivemindBackendConfig, ModelConfig
    from muloco.models import build_model

    api = case["api"]
    torch.manual_seed(0)  # the same initial model on every rank
    model = build_model(ModelConfig(**api["model"]), vocab_size=64)
    inner = muloco.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    if backend == "torch":
        wiring(backend, rank, world, case, rendezvous)  # the torchrun environment
        reducer = TorchDistBackend(timeout_s=WAIT_S)
    else:
        maddrs = "[]" if rank == 0 else wait_for_file(rendezvous / f"{case['name']}.maddrs")
        reducer = HivemindBackendConfig(
            run_id=case["name"],
            initial_peers=json.loads(maddrs),
            wait_for_peers=world,
            target_group_size=world,
        )
        handler = MaddrsToFile(rendezvous / f"{case['name']}.maddrs") if rank == 0 else None
        if handler is not None:
            logging.getLogger().addHandler(handler)
    compression = CompressionConfig(**api["compression"]) if api["compression"] else None
    diloco = muloco.DiLoCo(
        model,
        inner,
        sync_every=3,
        backend=reducer,
        compression=compression,
        **api["streaming"],
        total_steps=7,
    )
    tokens = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    seq_len = api["model"]["seq_len"]
    for _ in range(7):
        x = torch.randint(0, 64, (2, seq_len + 1), generator=tokens)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        inner.step()
        inner.zero_grad()
        diloco.step(loss)
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in diloco.global_params)).hexdigest()
    result = {"sha256": digest, "outer_steps": diloco.outer_steps, "transport": diloco.engine.transport}
    diloco.close()
    if backend == "torch":
        reducer.close()
    else:
        logging.getLogger().handlers = [
            h for h in logging.getLogger().handlers if not isinstance(h, MaddrsToFile)
        ]
    (rendezvous / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
    return 0


def main() -> None:
    faulthandler.enable()  # a rank that crashes in native code says where
    backend, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    plan, rendezvous = json.loads(Path(sys.argv[4]).read_text()), Path(sys.argv[5])
    # As `muloco train` sets it up, before any handler of ours is added (basicConfig then does nothing).
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from muloco.cli import main as muloco_main

    for case in plan["cases"]:
        extra, to_close = [], None
        try:
            if "api" in case:
                code = train_with_the_api(backend, rank, world, case, rendezvous)
            else:
                extra, to_close = wiring(backend, rank, world, case, rendezvous)
                code = muloco_main(["train", plan["config"], *case["overrides"], *extra])
        except BaseException as exc:  # noqa: BLE001 - recorded for the test, which shows this rank's log
            logging.exception("case %s failed", case["name"])
            code = f"raised {type(exc).__name__}"
            for suffix in (".maddrs", ".lighthouse"):  # the other ranks wait for one of these
                address = rendezvous / f"{case['name']}{suffix}"
                if rank == 0 and backend != "torch" and not address.exists():
                    address.write_text(FAILED)
        finally:
            if isinstance(to_close, logging.Handler):
                logging.getLogger().removeHandler(to_close)
            elif to_close is not None:
                # The lighthouse stays up until every other worker of the case is done with it.
                for other in range(1, world):
                    wait_for_file(rendezvous / f"{case['name']}.rank{other}.rc")
                to_close.shutdown()
        (rendezvous / f"{case['name']}.rank{rank}.rc").write_text(str(code))


if __name__ == "__main__":
    main()
