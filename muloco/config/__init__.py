"""The config schema: the single source of truth for every option (docs/design.md, "Config keys").

- `sections.py`: the training sections (run, model with `MODEL_PRESETS`, data, train) and `Section`, their
  base (unknown keys are errors); `exchange.py`: sync and compression; `optimizers.py`: inner (with its
  AdamW), outer, dp.
- `bits.py`: the allowed bit widths, which the compressors import from here.
- `runtime.py`: backends (local, torch, hivemind: the swarm's only schema, torchft), simulation,
  diagnostics, logging, checkpoint.
- `schema.py`: `Config`, the whole file: checks across sections, derived quantities, the fingerprint.
- `loading.py`: YAML file -> `extends:` chain merged -> dotted `KEY=VALUE` overrides -> validation; every
  failure is a one-line `ConfigError` naming the field (dotted path) and the fix (`load_config`);
  `field_error` words the errors of checks outside the schema (the inner optimizer's, muloco/optim/check.py)
  the same way.

The schema imports nothing of the packages it configures: it is the bottom of the layers (docs/design.md).

docs/configuration.md is generated from these classes by scripts/gen_config_docs.py.
"""

from muloco.config.exchange import CompressionConfig, SyncConfig
from muloco.config.loading import (
    _did_you_mean,
    apply_overrides,
    deep_merge,
    field_error,
    load_config,
    load_raw,
    parse_override,
    read_yaml,
    validate,
)
from muloco.config.optimizers import AdamWConfig, DpConfig, InnerConfig, OuterConfig
from muloco.config.runtime import (
    BackendConfig,
    CheckpointConfig,
    DiagnosticsConfig,
    HivemindAuthConfig,
    HivemindBackendConfig,
    LocalBackendConfig,
    LoggingConfig,
    SimulationConfig,
    TorchBackendConfig,
    TorchftBackendConfig,
)
from muloco.config.schema import Config
from muloco.config.sections import (
    MODEL_PRESETS,
    DataConfig,
    ModelConfig,
    RunConfig,
    Section,
    TrainConfig,
)
from muloco.errors import ConfigError

__all__ = [
    "MODEL_PRESETS",
    "AdamWConfig",
    "BackendConfig",
    "CheckpointConfig",
    "CompressionConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DiagnosticsConfig",
    "HivemindAuthConfig",
    "HivemindBackendConfig",
    "TorchftBackendConfig",
    "InnerConfig",
    "LocalBackendConfig",
    "LoggingConfig",
    "ModelConfig",
    "DpConfig",
    "OuterConfig",
    "RunConfig",
    "Section",
    "SimulationConfig",
    "SyncConfig",
    "TorchBackendConfig",
    "TrainConfig",
    "_did_you_mean",
    "apply_overrides",
    "deep_merge",
    "field_error",
    "load_config",
    "load_raw",
    "parse_override",
    "read_yaml",
    "validate",
]
