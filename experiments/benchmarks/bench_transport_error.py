"""How far each transport's applied mean is from the exact mean, on real pseudogradients: the second
quantization of reduce_scatter measured without the noise of diverging training runs.

Trains the pico model (configs/pico.yaml, fp32 syncs) for --steps inner steps at K workers and records
every replica's pseudogradient at every sync. Then it replays that sequence through each transport's codecs,
error-feedback buffers carried from sync to sync as in a run: all_gather (every message decoded and
averaged) and reduce_scatter (parts, owners' means re-quantized with mean_bits), and reports the relative
error ||applied - exact|| / ||exact|| averaged over the syncs, per bits and error feedback.

    python experiments/benchmarks/bench_transport_error.py --ks 4 8 --optimizers adamw muon
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from muloco.comm import LocalBackend
from muloco.compress import ErrorFeedback
from muloco.config import CompressionConfig, load_config
from muloco.models import param_roles
from muloco.run.trainer import Trainer
from muloco.sync import CollectiveReducer, Contribution
from muloco.sync.codec import PseudogradientCodec
from muloco.sync.scatter import PartitionedCodec

OUT = Path(__file__).parent / "results" / "bench_transport_error.json"


class Recorder:
    """An engine observer that keeps a copy of every replica's pseudogradient, sync by sync."""

    def __init__(self) -> None:
        self.syncs: list[list[list[torch.Tensor]]] = []
        self._current: list[list[torch.Tensor]] = []

    def observe(self, delta: list[torch.Tensor]) -> None:
        self._current.append([d.detach().clone() for d in delta])

    def stats(self, like) -> dict:
        self.syncs.append(self._current)
        self._current = []
        return {}

    def restart_from(self, params) -> None:
        pass


def record(K: int, optimizer: str, steps: int, seed: int) -> tuple[Trainer, list]:
    overrides = [
        f"workers={K}",
        f"inner.optimizer={optimizer}",
        f"train.total_tokens={steps * 2048}",
        f"run.seed={seed}",
        "run.output_dir=/tmp/bench_transport_error",
        f"run.name=k{K}_{optimizer}_s{seed}",
        "checkpoint.resume=never",
        "logging.progress=off",
        "train.eval_every=100000",
    ]
    trainer = Trainer(load_config("configs/pico.yaml", overrides))
    recorder = Recorder()
    trainer.engine.observer = recorder
    trainer.run()
    return trainer, recorder.syncs


def relative_errors(
    trainer: Trainer, syncs: list, bits: int, mean_bits: int, ef: bool, owner_ef: bool, transport: str
) -> tuple[list[float], float]:
    """Per sync ||applied - exact|| / ||exact||, and the same for the sums over all syncs (what error
    feedback bounds: the drift of everything applied from everything meant)."""
    model = trainer.replicas[0].model
    names = [n for n, _ in model.named_parameters()]
    roles, shapes = param_roles(model), [p.shape for p in model.parameters()]
    cfg = CompressionConfig(scheme="statistical", bits=bits, error_feedback=ef)
    codec = PseudogradientCodec.from_config(names, roles, cfg)
    K = len(syncs[0])
    if transport == "reduce_scatter":
        mean_codec = PseudogradientCodec.from_config(names, roles, cfg.model_copy(update={"bits": mean_bits}))
        codec = PartitionedCodec(codec, shapes, K, mean_codec.compressors)
    feedback = [ErrorFeedback(cfg.ef_decay, cfg.ef_alpha) if ef else None for _ in range(K)]
    owners = [ErrorFeedback(cfg.ef_decay, cfg.ef_alpha) if owner_ef else None for _ in range(K)]
    reducer = CollectiveReducer.over(LocalBackend(), workers=K)
    like = [torch.zeros(s) for s in shapes]
    errors = []
    applied_sum, exact_sum = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    for deltas in syncs:
        messages = [codec.encode(d, fb) for d, fb in zip(deltas, feedback, strict=True)]
        c = Contribution(0, 0, K, like, float(len(messages[0])), None, messages, codec, owners)
        mean = reducer.start_mean(c).wait().values
        exact = [sum(d[i] for d in deltas) / K for i in range(len(shapes))]
        num = sum((m - e).norm() ** 2 for m, e in zip(mean, exact, strict=True)) ** 0.5
        den = sum(e.norm() ** 2 for e in exact) ** 0.5
        errors.append(float(num / den))
        torch._foreach_add_(applied_sum, mean)
        torch._foreach_add_(exact_sum, exact)
    drift = sum((a - e).norm() ** 2 for a, e in zip(applied_sum, exact_sum, strict=True)) ** 0.5
    return errors, float(drift / sum(e.norm() ** 2 for e in exact_sum) ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--steps", type=int, default=300, help="inner steps (H = 15: steps / 15 syncs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # (transport, second stage bits: "same" or a number, owner error feedback: "same" as the workers' or on)
    variants = [
        ("all_gather", None, None),
        ("reduce_scatter", "same", "same"),
        ("reduce_scatter", "same", True),
        ("reduce_scatter", 4, "same"),
        ("reduce_scatter", 8, "same"),
    ]
    rows = []
    for optimizer in args.optimizers:
        for K in args.ks:
            trainer, syncs = record(K, optimizer, args.steps, args.seed)
            for bits in (8, 4, 2):
                for ef in (False, True):
                    for transport, second, owner in variants:
                        mean_bits = bits if second in (None, "same") else second
                        owner_ef = ef if owner in (None, "same") else owner
                        if transport == "reduce_scatter" and second != "same" and mean_bits <= bits:
                            continue
                        if owner is True and ef:
                            continue  # the same as "same"
                        errors, drift = relative_errors(
                            trainer, syncs, bits, mean_bits, ef, owner_ef, transport
                        )
                        rows.append(
                            {
                                "optimizer": optimizer,
                                "K": K,
                                "bits": bits,
                                "ef": ef,
                                "transport": transport,
                                "mean_bits": mean_bits if transport == "reduce_scatter" else None,
                                "owner_ef": owner_ef if transport == "reduce_scatter" else None,
                                "rel_error_mean": statistics.mean(errors),
                                "drift": drift,
                                "syncs": len(errors),
                            }
                        )
    print(
        f"{'opt':<6} {'K':>2} {'bits':>4} {'EF':<3} {'transport':<15} {'mean bits':>9} {'owner EF':>8} "
        f"{'rel err':>8} {'vs AG':>6} {'drift':>7} {'vs AG':>6}"
    )
    gather = {(r["optimizer"], r["K"], r["bits"], r["ef"]): r for r in rows if r["transport"] == "all_gather"}
    for r in rows:
        ag = gather[r["optimizer"], r["K"], r["bits"], r["ef"]]
        r["error_vs_all_gather"] = r["rel_error_mean"] / ag["rel_error_mean"]
        r["drift_vs_all_gather"] = r["drift"] / ag["drift"]
        owner = "-" if r["owner_ef"] is None else ("yes" if r["owner_ef"] else "no")
        ef = "yes" if r["ef"] else "no"
        print(
            f"{r['optimizer']:<6} {r['K']:>2} {r['bits']:>4} {ef:<3} {r['transport']:<15} "
            f"{r['mean_bits'] or '-':>9} {owner:>8} {r['rel_error_mean']:8.4f} "
            f"{r['error_vs_all_gather']:6.2f} {r['drift']:7.4f} {r['drift_vs_all_gather']:6.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
