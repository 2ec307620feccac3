"""The runtime sections of the config: backends (local, torch, hivemind, torchft), simulation, diagnostics,
logging, checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from muloco.config.sections import Section


class LocalBackendConfig(Section):
    bandwidth_mbps: float | None = Field(
        None,
        gt=0,
        description="WAN planner: project the run's wall-clock as if each worker had this upload "
        "bandwidth (Mbit/s); reported in summary.json as projected_*. null = no projection.",
    )
    latency_ms: float = Field(
        0.0,
        ge=0,
        description="WAN planner: one-way latency (ms), with bandwidth_mbps; a collective takes the longer "
        "of its bytes and its round trips (2K per all-reduce, K-1 per all-gather: docs/wan.md).",
    )


class TorchBackendConfig(Section):
    timeout_s: float = Field(
        300.0, gt=0, description="How long a collective waits for a missing rank before the run stops."
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl on CUDA, else gloo."
    )


class HivemindAuthConfig(Section):
    """Who belongs to the swarm (docs/security.md)."""

    key_file: str | None = Field(
        None,
        description="Pre-shared key file (`muloco swarm-key FILE` writes one, mode 0600); every peer of "
        "the run holds the same. Peers without it are never averaged with, served, loaded from or "
        "counted. null: an open swarm (a warning says so).",
    )
    allowed_peers: list[str] | None = Field(
        None,
        description="A closed swarm: only these peer ids (base58, as logged at start) take part; needs "
        "key_file and backend.hivemind.identity_path (a stable id), and must list this peer's own id.",
    )


class HivemindBackendConfig(Section):
    """The hivemind swarm's options: the one schema, passed as is to `muloco.comm.hivemind.HivemindSwarm`."""

    run_id: str = Field(
        "muloco", description="Prefix of every DHT key: swarms with different run_ids never mix."
    )
    peer_index: int | None = Field(
        None,
        ge=0,
        description="This peer's replica index r < workers (its data shard); null: the RANK the launcher "
        "sets, else 0. Give every peer of a swarm its own.",
    )
    initial_peers: list[str] = Field(
        default_factory=list, description="Multiaddrs of peers to join; empty: start a new swarm."
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        description="Where to listen; for other machines e.g. /ip4/0.0.0.0/tcp/31337.",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="Public addresses to announce (behind NAT / port forwarding)."
    )
    use_relay: bool = Field(True, description="Accept relayed connections (libp2p circuit relay).")
    use_auto_relay: bool = Field(
        False, description="Behind NAT: be reached through relays found among the peers."
    )
    identity_path: str | None = Field(None, description="Private key file for a persistent peer id.")
    matchmaking_time: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds to gather a group; null: derived from the sync size and bandwidth.",
    )
    averaging_timeout: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds for the payload exchange; null: derived likewise.",
    )
    min_group_size: int = Field(2, ge=2, description="Fewer peers than this: no group.")
    target_group_size: int | None = Field(
        None, ge=2, description="A group starts as soon as it has this many peers; null: no limit."
    )
    on_no_group: Literal["apply_own", "skip"] = Field(
        "apply_own", description="No group in time: apply this peer's own pseudogradient, or skip the step."
    )
    bandwidth_mbps: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="This peer's expected upload (Mbit/s), to derive the timeouts.",
    )
    max_norm_ratio: float = Field(
        10.0,
        gt=1,
        description="Exclude a contribution whose norm exceeds this x the group's median (.inf: never).",
    )
    outer_step_ttl: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a peer's published outer step counts (it republishes every outer step).",
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a joining peer waits for the swarm's state (and for wait_for_peers).",
    )
    wait_for_peers: int = Field(
        1,
        ge=1,
        description="At start, wait until this many peers (this one included) are in the swarm, so they "
        "begin in step; `muloco launch --backend hivemind --nproc N` sets N.",
    )
    auth: HivemindAuthConfig = Field(default_factory=HivemindAuthConfig)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_key_prefix(cls, run_id: str) -> str:
        if not run_id or not all(c.isascii() and (c.isalnum() or c in "_-") for c in run_id):
            raise ValueError(f"must be letters, digits, '_' or '-' (it prefixes DHT keys), got {run_id!r}")
        return run_id

    @field_validator("host_maddrs")
    @classmethod
    def _somewhere_to_listen(cls, maddrs: list[str]) -> list[str]:
        if not maddrs:
            raise ValueError("must not be empty; listen somewhere, e.g. ['/ip4/0.0.0.0/tcp/0']")
        return maddrs

    @field_validator(
        "matchmaking_time",
        "averaging_timeout",
        "bandwidth_mbps",
        "max_norm_ratio",
        "outer_step_ttl",
        mode="before",
    )
    @classmethod
    def _not_a_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # pydantic would read true as 1.0
            raise ValueError(f"must be a number, got {value!r}")
        return value

    @model_validator(mode="after")
    def _target_fits_min(self) -> HivemindBackendConfig:
        if self.auth.allowed_peers is not None and (self.auth.key_file is None or self.identity_path is None):
            raise ValueError(
                "backend.hivemind.auth.allowed_peers needs auth.key_file and backend.hivemind.identity_path "
                "(a stable peer id to list); set both"
            )
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ValueError(
                f"backend.hivemind.target_group_size ({self.target_group_size}) must be null or >= "
                f"min_group_size ({self.min_group_size}); raise it or lower min_group_size"
            )
        return self


class TorchftBackendConfig(Section):
    """One worker of an elastic run on torchft (`pip install -e ".[torchft]"`; docs/backends.md)."""

    lighthouse: str | None = Field(
        None,
        description="The torchft lighthouse's address, e.g. http://head-node:29510; null: the "
        "TORCHFT_LIGHTHOUSE environment variable. `muloco launch --backend torchft` starts one and sets it, "
        "or joins the one named here.",
    )
    replica_id: int | None = Field(
        None,
        ge=0,
        description="This worker's index r < workers (its data shard and its name at the lighthouse); "
        "null: the RANK the launcher sets, else 0 (needed with ranks_per_worker > 1). A restarted worker "
        "keeps its index; `muloco launch --backend torchft` numbers its workers from it.",
    )
    hostname: str | None = Field(
        None,
        description="The name or address other workers reach this one by (its torchft manager, store and "
        "state server are advertised under it); null: this machine's hostname.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="How long a sync's collectives and a state transfer wait for a worker that died "
        "mid-sync before the sync is retried with a new quorum of those present.",
    )
    quorum_timeout_s: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="How long one attempt to form a quorum at a sync may take. Keep it above one round "
        "(H inner steps): a worker whose sync failed while the others' committed waits for their next sync "
        "to catch up (docs/backends.md).",
    )
    quorum_retries: int = Field(
        3, ge=0, description="Failed quorums or syncs retried in a row before the run fails (logged)."
    )
    wait_for_workers: int | None = Field(
        None,
        ge=1,
        description="At the start of a new run, wait (at most join_timeout_s) until this many workers are "
        "known to the lighthouse, so the first sync has them all; null: workers. A worker that joins a "
        "running job never waits.",
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="The start's wait for wait_for_workers; the launcher's lighthouse also waits this long "
        "for a live worker that has not asked for a quorum yet before forming one without it.",
    )
    min_replicas: int = Field(
        1,
        ge=1,
        description="A sync commits only with at least this many workers in its quorum (the launcher's "
        "lighthouse uses it too).",
    )
    heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="The launcher's lighthouse: a worker silent this long is dead, and the next quorum "
        "forms without it.",
    )


class BackendConfig(Section):
    kind: Literal["local", "torch", "hivemind", "torchft"] = Field(
        "local",
        description="local: all replicas in this process; torch: torch.distributed, one process per rank "
        "(`muloco launch --nproc N` or torchrun; under torchrun `local` switches to `torch` by itself); "
        "hivemind: one peer of a decentralized swarm; torchft: one worker of an elastic cluster run, "
        "which goes on when a worker dies and takes it back live (docs/backends.md).",
    )
    local: LocalBackendConfig = Field(default_factory=LocalBackendConfig)
    torch: TorchBackendConfig = Field(default_factory=TorchBackendConfig)
    hivemind: HivemindBackendConfig = Field(default_factory=HivemindBackendConfig)
    torchft: TorchftBackendConfig = Field(default_factory=TorchftBackendConfig)


class SimulationConfig(Section):
    offload: bool = Field(
        False,
        description="Keep inactive replicas' parameters and optimizer state on the CPU (CUDA runs); the next "
        "replica is copied in on a side stream while the current one computes.",
    )
    batched: bool | Literal["auto"] = Field(
        "auto",
        description="Step a process's replicas together: each computes its gradients, then one optimizer "
        "step updates all of them (one Newton-Schulz call per matrix shape for all replicas; "
        "muloco/run/batched.py). Same results as one replica after another. auto: on where it measured "
        "faster (docs/records/benchmarks.md) and possible (no offload, ranks_per_worker=1).",
    )


class DiagnosticsConfig(Section):
    alignment: bool = Field(
        False,
        description="Log how the workers' pseudogradients align with each other and with one replica "
        "trained on the union of their batches (muloco/run/alignment.py); doubles the compute; simulation "
        "only.",
    )


class LoggingConfig(Section):
    wandb: bool = Field(False, description="Log to Weights & Biases (offline when no API key is set).")
    wandb_project: str = Field("muloco", description="wandb project.")
    wandb_group: str | None = Field(None, description="wandb group (sweeps set it).")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="auto: a progress bar on a terminal, plain log lines otherwise."
    )

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off_is_false(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` / `on` as a bool.
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class CheckpointConfig(Section):
    every: int = Field(
        0, ge=0, description="Every N outer steps (dp: N steps); 0 = at the end and on interrupt only."
    )
    keep: int = Field(2, gt=0, description="How many checkpoints to keep.")
    resume: str = Field(
        "auto", description="auto: newest valid checkpoint of this run dir, if any; never; or a path."
    )
