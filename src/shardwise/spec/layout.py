"""The RunSpec's sections of the layout: parallel degrees on one device mesh, workers, device and
backend ([parallel]), and trading compute for memory ([memory]). Torch-free; checks that need the
world size are `shardwise.parallel.dims`'s, at launch."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least, choice, positive

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CP_COMMS = ("ring", "allgather")  # how context parallel moves K/V (parallel.context)
AC_MODES = ("none", "full", "selective")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
TIMEOUT_MAX_S = 7 * 24 * 3600  # parallel.timeout_s: a week


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
    # gradient buckets of data parallel (DDP, and the optimizers' reduction under tp/pp with
    # zero 0/1), in MB: each bucket's reduction starts during backward once its last gradient is
    # ready; smaller buckets start sooner, larger ones send fewer messages
    bucket_mb: float = 25.0
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
        positive("parallel.bucket_mb", self.bucket_mb)
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
