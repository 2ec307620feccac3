"""Where a run's first weights come from: the model's own seeded init, a pretrained Hugging Face directory
(`model.hf.pretrained`) or another muloco run's global parameters (`model.init_from`).

`initialize` is called once on the freshly built model, before the replicas copy it. It returns what was
loaded with a digest of the loaded weights: a resumed run checks the digest, so a source changed under a
run is a one-line error, not a silent mix (the path is in the config fingerprint already).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from muloco.checkpoint.weights import load_weights, read_run_weights, weights_digest
from muloco.errors import CheckpointError, ConfigError, one_line
from muloco.models.hf import load_pretrained, pretrained_dir


@dataclass(frozen=True)
class InitSource:
    field: str  # the config key that named it
    path: str
    digest: str  # weights_digest of the model right after loading

    def describe(self) -> str:
        return f"{self.field}={self.path} (weights {self.digest})"

    def check_resumed(self, checkpoint_digest: str | None, checkpoint: Path) -> None:
        """A resumed run must start from the weights its checkpoints were trained from."""
        if checkpoint_digest != self.digest:
            raise CheckpointError(
                f"{self.field}: the weights at {self.path} changed since checkpoint {checkpoint} was written "
                f"(digest {self.digest}, then {checkpoint_digest}); restore them, or start over "
                "with checkpoint.resume=never"
            )


def initialize(model: nn.Module, model_cfg) -> InitSource | None:
    """Load the weights `model_cfg` names into `model` (built by build_model); None: keep its own init."""
    if model_cfg.init_from is not None:
        weights = read_run_weights(model_cfg.init_from, field="model.init_from")
        load_weights(model, weights)
        return InitSource("model.init_from", str(weights.path), weights_digest(model))
    directory = pretrained_dir(model_cfg.hf)
    if directory is None:
        return None
    source = load_pretrained(directory)
    try:
        model.net.load_state_dict(source.state_dict())
    except RuntimeError as exc:
        raise ConfigError(
            f"model.hf.pretrained: {directory} does not fit its own config ({one_line(exc)[:300]})"
        ) from None
    del source
    return InitSource("model.hf.pretrained", str(directory), weights_digest(model))
