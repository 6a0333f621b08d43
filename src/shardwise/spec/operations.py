"""The RunSpec's sections of how a run is kept and watched: failures and faults ([failure]),
checkpoints, logs, telemetry, and the will-it-fit check ([fit]). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least, positive
from shardwise.spec.failure import parse_faults, parse_signals


@dataclass(frozen=True)
class FailureSection:
    """What happens when a worker dies, and faults to inject for drills and tests."""

    max_restarts: int = 0  # the elastic agent restarts every worker up to N times; each resumes
    faults: str = ""  # e.g. "kill:rank=1:step=3:phase=backward" (see shardwise.resilience.faults)
    # Non-finite gradients skip the step; this many in a row roll back to the last checkpoint
    # and skip the offending batches (0: only skip). fp16 runs back off the loss scale instead.
    nan_patience: int = 3
    # At most this many rollbacks in one launch: a state that diverges on every batch ends the
    # run with a message instead of skipping data forever.
    max_rollbacks: int = 3
    # A step or collective that makes no progress for this long is a hang: every rank's last
    # collectives are written down, a report names the ranks that diverged, the job exits.
    # 0 disables the watchdog (the backend's parallel.timeout_s still applies).
    hang_timeout_s: float = 120.0
    # A rank whose compute time (step time minus time waiting in collectives) is above
    # `straggler_factor` x the median for `straggler_windows` log windows in a row is named.
    straggler_factor: float = 1.5
    straggler_windows: int = 2
    # Preemption: on any of these signals (what Slurm sends before a time limit or a preemption)
    # every rank finishes its step, a checkpoint is committed and the run exits with code 75 so
    # that a requeued or re-launched job resumes from it. "" disables the handling.
    preempt_signals: str = "SIGTERM,SIGUSR1"
    # Seconds between the signal and the hard kill: the save must commit within it. Slurm's
    # `--signal=USR1@GRACE` and torchrun's `--shutdown-timeout` are set from it.
    preempt_grace_s: float = 120.0

    def validate(self) -> None:
        at_least("failure.preempt_grace_s", self.preempt_grace_s, 1)
        parse_signals(self.preempt_signals)
        at_least("failure.max_restarts", self.max_restarts, 0)
        at_least("failure.nan_patience", self.nan_patience, 0)
        positive("failure.max_rollbacks", self.max_rollbacks)
        at_least("failure.hang_timeout_s", self.hang_timeout_s, 0)
        if not self.straggler_factor > 1.0:
            raise SpecError(f"failure.straggler_factor is {self.straggler_factor}; it must be "
                            "above 1 (a rank this many times slower than the median is named).")
        positive("failure.straggler_windows", self.straggler_windows)
        parse_faults(self.faults)


@dataclass(frozen=True)
class CheckpointSection:
    """Sharded checkpoints under RUN_DIR/checkpoints/step-NNNNNN/ (or `uri`/step-NNNNNN/)."""

    every: int = 0  # 0 -> only at the end of the run
    enabled: bool = True
    keep_last: int = 3  # retention: the newest N checkpoints (0 keeps all) ...
    keep_every: int = 0  # ... plus every checkpoint whose step is a multiple of this (0: none)
    # The step loop waits only for the copy to host memory; the write and commit run in the
    # background (one save in flight at a time). False: the loop waits for the whole save.
    async_save: bool = True
    # Where checkpoints go: "" -> RUN_DIR/checkpoints; a local directory; or s3://BUCKET/PREFIX
    # (S3-compatible storage through s3fs: pip install 'shardwise[s3]'). One prefix per run.
    uri: str = ""
    # S3 only. Credentials never go here (the spec is copied into every checkpoint): they come from
    # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or the profile named below.
    endpoint_url: str = ""  # an S3-compatible server (MinIO, Ceph...); "" -> $AWS_ENDPOINT_URL or AWS
    region: str = ""  # "" -> $AWS_REGION / $AWS_DEFAULT_REGION
    profile: str = ""  # a profile of ~/.aws/credentials; "" -> environment, then the default chain
    # model.family = "hf": after the run, export the final checkpoint as a from_pretrained
    # directory here ("" -> no export; a relative path is inside the run directory)
    hf_export: str = ""

    def validate(self) -> None:
        at_least("checkpoint.every", self.every, 0)
        at_least("checkpoint.keep_last", self.keep_last, 0)
        at_least("checkpoint.keep_every", self.keep_every, 0)
        scheme, sep, rest = self.uri.strip().partition("://")
        if sep and scheme not in ("s3", "file"):
            raise SpecError(f"checkpoint.uri = {show(self.uri)}: the scheme {show(scheme)} is not "
                            "supported. Use s3://BUCKET/PREFIX for S3-compatible storage, a local "
                            "directory, or \"\" for RUN_DIR/checkpoints.")
        if scheme == "s3" and sep:
            bucket = rest.split("/", 1)[0]
            if "@" in bucket or ":" in bucket:
                raise SpecError(f"checkpoint.uri = {show(self.uri)} carries credentials or a port; "
                                "write s3://BUCKET/PREFIX, put the server in checkpoint.endpoint_url "
                                "and the keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.")
            if not bucket:
                raise SpecError(f"checkpoint.uri = {show(self.uri)} names no bucket; write "
                                "s3://BUCKET/PREFIX.")
        if (self.endpoint_url or self.region or self.profile) and not (sep and scheme == "s3"):
            raise SpecError("checkpoint.endpoint_url, region and profile apply to s3:// URIs only; "
                            f"checkpoint.uri is {show(self.uri)}. Set checkpoint.uri = "
                            "\"s3://BUCKET/PREFIX\" or clear them.")
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise SpecError(f"checkpoint.endpoint_url = {show(self.endpoint_url)} must start with "
                            "http:// or https:// (e.g. http://127.0.0.1:9000).")


@dataclass(frozen=True)
class LogSection:
    """Metrics cadence and sinks."""

    every: int = 10
    tensorboard: bool = True
    progress: bool = True  # the rich progress bar on rank 0 (plain lines when not a terminal)

    def validate(self) -> None:
        positive("log.every", self.every)


@dataclass(frozen=True)
class TelemetrySection:
    """What a run measures about itself beyond loss: FLOPs/MFU, communication, traces, sinks."""

    peak_flops: float = 0.0  # per device, FLOP/s; 0: the device table (GPU) or a cached CPU probe
    comm: bool = True  # count every collective by op, mesh axis, bytes and time
    trace_from: int = 3  # first step of the Chrome trace window (RUN_DIR/trace/rank-K.json)
    trace_steps: int = 2  # steps in the trace window; 0 disables the trace
    prometheus_port: int = 0  # rank 0 serves /metrics on this port when > 0
    prometheus_host: str = "127.0.0.1"
    mlflow: bool = False  # log params, metrics and artifacts to MLflow (needs mlflow installed)
    # what one device costs per hour (any currency): `shardwise compare` and `scale` turn the
    # device-hours a run held into its cost; 0: unknown, no cost is shown
    price_per_device_hour: float = 0.0

    def validate(self) -> None:
        at_least("telemetry.peak_flops", self.peak_flops, 0)
        at_least("telemetry.price_per_device_hour", self.price_per_device_hour, 0.0)
        at_least("telemetry.trace_from", self.trace_from, 1)
        at_least("telemetry.trace_steps", self.trace_steps, 0)
        if not 0 <= self.prometheus_port <= 65535:
            raise SpecError(f"telemetry.prometheus_port is {self.prometheus_port}; use 0 (off) "
                            "or a port number up to 65535.")


@dataclass(frozen=True)
class FitSection:
    """The will-it-fit check `shardwise train` runs before it starts a worker: the planner's
    memory model (`shardwise.planner`) for this layout on this device."""

    strict: bool = False  # refuse to start (exit 2) when a rank is predicted not to fit; else warn
    device_memory_gib: float = 0.0  # memory per device to check against; 0: what the device has

    def validate(self) -> None:
        at_least("fit.device_memory_gib", self.device_memory_gib, 0.0)
        if self.device_memory_gib > 2**20:
            raise SpecError(f"fit.device_memory_gib is {self.device_memory_gib}: that is more "
                            "than a PiB per device; give GiB per device (0: what it has).")
