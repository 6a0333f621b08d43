"""The RunSpec reference, generated from the code: every section of the RunSpec (and of the
cluster file `shardwise plan --cluster FILE` reads), every key with its TOML type, default,
accepted values and description — `docs/runspec.md`.

    python -m shardwise.spec.reference > docs/runspec.md          # regenerate
    python -m shardwise.spec.reference --check docs/runspec.md    # exit 1 when it is stale

Where each part comes from:
- sections, keys, types and defaults: the dataclasses (`dataclasses.fields`, their type hints);
- descriptions: the source of the module that defines a section, read with `ast` and `tokenize`:
  the comment lines right above a field and the comment after it on its line, and the section's
  docstring. A field the source leaves uncommented gets its line from `FIELD_NOTES` below
  (`tests/unit/test_docs_reference.py` fails when a field has neither, and when a note names a
  field that no longer exists), so the source stays the first place to document a field;
- accepted values and bounds: each section's `validate()` and `_validate_*()` methods, from their
  unconditional `_choice`, `_positive` and `_at_least` calls (checks made only in some cases are
  left to the description).

Imports no torch: only the spec layer and the standard library.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.spec import cluster, failure, model, runspec
from shardwise.spec.toml import toml_value as _toml_value

REGENERATE = "python -m shardwise.spec.reference > docs/runspec.md"
CHECK = "python -m shardwise.spec.reference --check docs/runspec.md"

#: Descriptions of the fields the source leaves without a comment, keyed `section.key` (the
#: cluster file's sections and the fault grammar's keys included). A note is appended to the
#: source's own comment where there is one, so it only adds what the comment does not say.
FIELD_NOTES: dict[str, str] = {
    # [run]
    "run.name": "The run's name: the run directory is `runs/<name>-<timestamp>` unless `dir` is "
                "set. One plain path component: letters, digits, `.`, `_`, `-`, not starting with "
                "`.` or `-`, at most 100 characters.",
    "run.dir": "A relative path is relative to where shardwise runs.",
    "run.seed": "Seeds the model's initialisation, the data order (a keyed permutation of seed "
                "and epoch) and sampling; the same seed gives the same samples at every layout.",
    "run.precision": "One mixed-precision policy on every layout: fp32 master weights, gradients "
                     "and optimizer state; `bf16`/`fp16` matmuls and attention under autocast; "
                     "`fp16` adds dynamic loss scaling (`[loss_scale]`). See [precision.md](precision.md).",
    "run.determinism": "See [reproducibility.md](reproducibility.md).",
    # [model]
    "model.family": "`gpt` (the built-in), `moe-gpt` (the built-in mixture of experts, shaped by "
                    "the `moe_*` keys), `hf` (a Hugging Face model, `hf_config` or `hf_path`), "
                    "`\"py:FILE.py:FUNCTION\"` (your own `nn.Module`, built by "
                    "`FUNCTION(args, vocab_size)`), or a name an installed package registers "
                    "under the `shardwise.models` entry points. See [models.md](models.md).",
    "model.init": "`meta`: built on the meta device, each rank materialises only the tensors it "
                  "keeps, with the eager build's values bit for bit; `eager`: every rank builds "
                  "the whole model first.",
    "model.hf_path": "Family `hf`: a local `save_pretrained` directory (`config.json` and "
                     "`model.safetensors`) to fine-tune; never a hub id (nothing is downloaded). "
                     "Exactly one of `hf_config` and `hf_path`. See [huggingface.md](huggingface.md).",
    "model.n_layers": "GPT families: transformer blocks.",
    "model.d_model": "GPT families: model width; a multiple of `n_heads` with an even head width "
                     "(rotary embeddings).",
    "model.n_heads": "GPT families: attention heads.",
    "model.n_kv_heads": "GPT families: key/value heads (grouped-query attention); divides "
                        "`n_heads`.",
    "model.tie_embeddings": "GPT families: the output projection is the input embedding (one "
                            "tensor on every layout).",
    "model.rope_theta": "GPT families: base of the rotary position embedding.",
    "model.norm_eps": "GPT families: epsilon of RMSNorm.",
    "model.init_std": "GPT families: standard deviation of the weight initialisation.",
    "model.moe_experts": "E, experts per MoE layer.",
    "model.moe_top_k": "k, experts each token is routed to (at most `moe_experts`).",
    # [data]
    "data.seq_len": "Text: tokens per training sequence (packed from the token stream).",
    "data.val_fraction": "Text: the last fraction of the token stream, held out for evaluation.",
    "data.content_hash": "Filled in at run time (SHA-256 of the data) and checked on resume; "
                         "clear it to accept changed data.",
    "data.tokenizer_hash": "Filled in at run time (SHA-256 of the tokenizer) and checked on "
                           "resume.",
    # [batch]
    "batch.global_batch": "Sequences (samples) per optimizer step, over all ranks.",
    "batch.micro_batch": "Sequences per forward pass per rank; gradient accumulation = "
                         "global_batch / (micro_batch × data-parallel degree), checked.",
    # [optimizer]
    "optimizer.name": "The optimizer: AdamW, one per model part.",
    "optimizer.lr": "Peak learning rate, reached after `warmup_steps`.",
    "optimizer.min_lr": "Learning rate at the end of the cosine schedule (at most `lr`).",
    "optimizer.warmup_steps": "Steps of linear warmup.",
    "optimizer.schedule": "`cosine`: from `lr` down to `min_lr` over `run.steps`; `constant`.",
    "optimizer.beta1": "AdamW's first-moment decay, in [0, 1).",
    "optimizer.beta2": "AdamW's second-moment decay, in [0, 1).",
    "optimizer.eps": "AdamW's epsilon.",
    "optimizer.weight_decay": "Decoupled weight decay, on matrices only.",
    # [parallel]
    "parallel.dp_replicate": "Data-parallel replicas (DDP, or HSDP's replicate dimension).",
    "parallel.dp_shard": "Data-parallel ranks that shard state (ZeRO/FSDP); -1: every rank the "
                         "other degrees leave.",
    "parallel.tp": "Tensor-parallel degree (Megatron column/row split).",
    "parallel.pp": "Pipeline-parallel degree.",
    "parallel.cp": "Context-parallel degree: every sequence split over `cp` ranks, ring "
                   "attention. See [layouts.md](layouts.md).",
    "parallel.ep": "Expert-parallel degree (mixture-of-experts models): experts spread over "
                   "`ep` ranks borrowed from data and context parallel; divides dp_replicate × "
                   "dp_shard × cp.",
    "parallel.zero": "What is sharded along dp_shard: 0 nothing (DDP), 1 optimizer state, 2 also "
                     "gradients, 3 also parameters; -1: 3 when dp_shard > 1, else 0.",
    "parallel.pp_schedule": "Pipeline schedule; `interleaved-1f1b` needs `pp_virtual_stages` ≥ 2, "
                            "`zero-bubble` (ZB-V) `pp_virtual_stages` = 2.",
    # [memory]
    "memory.ac_every": "With `activation_checkpoint = \"selective\"`: checkpoint every N-th block.",
    # [loss_scale]
    "loss_scale.init_scale": "fp16: the loss scale at the first step.",
    "loss_scale.growth_factor": "fp16: the scale is multiplied by this after `growth_interval` "
                                "good steps (above 1).",
    "loss_scale.backoff_factor": "fp16: the scale is multiplied by this when a step overflows "
                                 "(in (0, 1)).",
    "loss_scale.growth_interval": "fp16: good steps in a row before the scale grows.",
    # [failure]
    "failure.max_restarts": "from the newest valid checkpoint (or from step 0 when the failure "
                            "came before the first one).",
    "failure.straggler_windows": "Log windows in a row a rank must stay above "
                                 "`straggler_factor` to be named a straggler.",
    # [eval]
    "eval.batches": "Global batches of the held-out split per evaluation (the same sequences "
                    "on every layout).",
    # [checkpoint]
    "checkpoint.enabled": "false: no checkpoints at all (nothing to resume).",
    # [log]
    "log.every": "Steps between `step` events (metrics.jsonl, TensorBoard, the progress line).",
    "log.tensorboard": "TensorBoard event files in RUN_DIR/tb/.",
    # [telemetry]
    "telemetry.prometheus_host": "The address rank 0's Prometheus endpoint binds to.",
    # [sample]
    "sample.prompt": "Text the sample starts from.",
    "sample.temperature": "Sampling temperature.",
    "sample.top_k": "Sample among the k most likely tokens (0: all).",
    # the cluster file
    "cluster.nodes": "Nodes in the cluster (`shardwise plan --nodes` overrides it).",
    "cluster.devices_per_node": "Devices (GPUs, or CPU workers) per node.",
    "cluster.device_memory_gib": "Usable memory per device, GiB (what nvidia-smi reports as "
                                 "total).",
    "cluster.nics_per_node": "Inter-node NICs per node (one per GPU on a rail-optimised fabric).",
    "cluster.name": "The cluster's name in `shardwise plan`'s output.",
    "cluster.device": "`cuda` or `cpu`: what `shardwise plan --write-spec` asks for.",
    "peak_tflops.fp32": "Dense fp32 TFLOP/s per device (CUDA cores).",
    "peak_tflops.bf16": "Dense bf16 TFLOP/s per device.",
    "peak_tflops.fp16": "Dense fp16 TFLOP/s per device.",
    "peak_tflops.tf32": "fp32 matmuls on TF32 tensor cores (0: none; `run.tf32` uses them).",
    "link.bandwidth_gbs": "GB/s (10^9 bytes/s) per direction: per device inside a node "
                          "(`[intra]`), per NIC between nodes (`[inter]`).",
    "link.latency_us": "Latency per ring step, µs.",
    # failure.faults
    "fault.kind": "What the fault does (the first part of the fault).",
    "fault.rank": "The rank it fires on; unset: every rank.",
    "fault.step": "The step it fires at (steps count from 1); unset: every step.",
    "fault.phase": "The phase of the step it fires in; unset: any.",
    "fault.ms": "`slow`: milliseconds to sleep in every step.",
    "fault.attempt": "The restart attempt it fires in (0: the first launch only, so that the "
                     "restarted run gets past it).",
}


@dataclass(frozen=True)
class Key:
    """One documented field: where it is, what it is."""

    table: str  # the TOML table it sits in
    name: str
    type: str
    default: str  # TOML, or "" when the field is required
    values: str  # accepted values / bounds read from validate(), "" if none
    doc: str


@dataclass(frozen=True)
class Table:
    name: str  # as written in TOML: "run", "peak_tflops", ...
    doc: str
    keys: tuple[Key, ...]
    title: str = ""  # the heading, when not just `[name]` (a model family's keys)


def run_tables() -> list[Table]:
    """Every section of the RunSpec, in the order of `RunSpec`'s fields; [model] as its head
    (family, init) followed by one table per family of the keys that family owns."""
    tables = []
    for f, cls in _sections(runspec.RunSpec):
        if cls is model.ModelSection:
            tables += model_tables()
        else:
            tables.append(_table(f.name, cls, f.name))
    return tables


def model_tables() -> list[Table]:
    """[model]'s own keys, then each family's (a family built on another lists only the keys
    it adds; `spec/model.py` is the registry)."""
    head = _table("model", model.ModelSection, "model", skip={"fields"})
    tables = [head]
    for family, cls in _families():
        base = {f.name for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)
                for f in dataclasses.fields(b)}
        tables.append(_table("model", cls, "model", skip=base,
                             title=f"`[model]`, family {family}"))
    return tables


def _families() -> list[tuple[str, type]]:
    return [*((f"`{name}`", cls) for name, cls in model.FAMILY_FIELDS.items()),
            ("`py:FILE.py:FUNCTION` or a registered name", model.BuilderFields)]


def cluster_tables() -> list[Table]:
    """Every section of a cluster file (`shardwise.spec.cluster.ClusterSpec`)."""
    tables = []
    for f, cls in _sections(cluster.ClusterSpec):
        note_prefix = "link" if cls is cluster.LinkSection else f.name
        tables.append(_table(f.name, cls, note_prefix))
    return tables


def fault_keys() -> list[Key]:
    """The keys of one `failure.faults` entry (`shardwise.spec.failure.Fault`)."""
    return list(_table("fault", failure.Fault, "fault").keys)


def missing_docs() -> list[str]:
    """`section.key` of every field that neither the source nor `FIELD_NOTES` describes."""
    return [f"{t.name}.{k.name}" for t in (*run_tables(), *cluster_tables())
            for k in t.keys if not k.doc] + \
        [f"fault.{k.name}" for k in fault_keys() if not k.doc]


def note_keys() -> set[str]:
    """The `section.key` names `FIELD_NOTES` may use: every documented field."""
    return {f"{prefix}.{f.name}" for prefix, cls in _note_classes()
            for f in dataclasses.fields(cls)}


def render() -> str:
    """docs/runspec.md."""
    out = [
        f"<!-- Generated from the code by `{REGENERATE}`; do not edit by hand. "
        f"`{CHECK}` (and tests/unit/test_docs_reference.py) fails when it is stale. -->",
        "",
        "# RunSpec reference",
        "",
        "Every key of the RunSpec, the TOML file `shardwise train`, `verify` and `launch` read. "
        "One table per section; every key has a default, so a file sets only what differs. "
        "`--set section.key=value` overrides any key (the value is read as TOML: "
        "`--set run.steps=200`, `--set 'model.args={width = 128}'`), and "
        "`shardwise train --print-spec` prints the resolved spec. An unknown section or key, or a "
        "value of the wrong type, exits 2 naming it (with a \"did you mean\"). The *values* column "
        "lists what `validate()` checks for every run; checks that depend on other keys, the layout "
        "or the world size are in the descriptions and in the topic guides "
        "([docs/README.md](README.md)).",
        "",
        "```toml",
        "[run]",
        "steps = 200",
        "",
        "[parallel]",
        "dp_shard = 2",
        "tp = 2",
        "```",
        "",
        "Types are TOML's: a `table` key takes an inline table (`args = { width = 256 }`) of "
        "strings, numbers, booleans, and arrays and tables of them, passed to your code as it is.",
        "",
        "Sections: " + ", ".join(f"[`[{t.name}]`](#{_slug(t.name)})" for t in run_tables()
                                 if not t.title) + ".",
        "",
    ]
    for table in run_tables():
        out += _render_table(table)
        if table.name == "failure":
            out += _render_faults()
    out += [
        "## The cluster file (`shardwise plan --cluster FILE`)",
        "",
        "The machines a run is planned for, read like a RunSpec (unknown keys and wrong types exit "
        "2). `[cluster] base = \"PRESET\"` starts from one of `shardwise plan`'s cluster presets "
        "and changes only what differs; without a base, every key marked *required* must be "
        "given. See [planning.md](planning.md).",
        "",
    ]
    for table in cluster_tables():
        out += _render_table(table, level="###")
    return "\n".join(out).rstrip("\n") + "\n"


# --- the dataclasses -------------------------------------------------------------------------


def _sections(spec_cls: type) -> Iterator[tuple[dataclasses.Field[Any], type]]:
    hints = typing.get_type_hints(spec_cls)
    for f in dataclasses.fields(spec_cls):
        yield f, hints[f.name]


def _note_classes() -> Iterator[tuple[str, type]]:
    for f, cls in _sections(runspec.RunSpec):
        yield f.name, cls
    for _, cls in _families():
        yield "model", cls
    for f, cls in _sections(cluster.ClusterSpec):
        yield ("link" if cls is cluster.LinkSection else f.name), cls
    yield "fault", failure.Fault


def _table(name: str, cls: type, note_prefix: str, skip: set[str] | frozenset[str] = frozenset(),
           title: str = "") -> Table:
    source = _Source.of(cls)
    hints = typing.get_type_hints(cls)
    checks = source.checks(cls.__name__)
    keys = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        doc = _join([source.comment(cls.__name__, f.name),
                     FIELD_NOTES.get(f"{note_prefix}.{f.name}", "")])
        keys.append(Key(name, f.name, _toml_type(hints[f.name]), _default(f),
                        checks.get(f.name, ""), doc))
    return Table(name, _docstring(cls), tuple(keys), title)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "unset"
    return _toml_value(value)


def _toml_type(hint: Any) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = [_toml_type(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(parts)
    origin = typing.get_origin(hint)
    if origin is dict:
        return "table"
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"array of {_toml_type(args[0])}s" if args else "array"
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(hint, str(hint))


def _docstring(cls: type) -> str:
    text = inspect.getdoc(cls) or ""
    if text.startswith(f"{cls.__name__}(") or not text:  # dataclass's generated signature
        return ""
    return " ".join(text.split())


# --- the source: comments and validate() --------------------------------------------------------


class _Source:
    """One module's source: the comments beside each dataclass field, and what each class's
    validation methods check unconditionally."""

    _cache: typing.ClassVar[dict[str, _Source]] = {}

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        text = inspect.getsource(module)
        self.lines = text.splitlines()
        self.tree = ast.parse(text)
        self.comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                self.comments[tok.start[0]] = tok.string.lstrip("#").strip()
        self.classes = {node.name: node for node in ast.walk(self.tree)
                        if isinstance(node, ast.ClassDef)}

    @classmethod
    def of(cls, dataclass_type: type) -> _Source:
        module = sys.modules[dataclass_type.__module__]
        if module.__name__ not in cls._cache:
            cls._cache[module.__name__] = cls(module)
        return cls._cache[module.__name__]

    def comment(self, class_name: str, field_name: str) -> str:
        """The comment lines right above the field, then the comment on its own line(s)."""
        for node in self.classes[class_name].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == field_name:
                above: list[str] = []
                line = node.lineno - 1
                while line >= 1 and self.lines[line - 1].strip().startswith("#"):
                    above.insert(0, self.comments.get(line, ""))
                    line -= 1
                after = [self.comments[n] for n in range(node.lineno, (node.end_lineno or
                                                                       node.lineno) + 1)
                         if n in self.comments]
                return _join([" ".join(above), *after])
        return ""

    def checks(self, class_name: str) -> dict[str, str]:
        """field -> accepted values, from the unconditional `choice` / `positive` /
        `at_least` calls (spec.checks) of the class's `validate` and `_validate_*` methods."""
        found: dict[str, list[str]] = {}
        for node in self.classes[class_name].body:
            if isinstance(node, ast.FunctionDef) and (node.name == "validate"
                                                      or node.name.startswith("_validate")):
                for statement in node.body:
                    for name, text in self._statement_checks(statement):
                        if text not in found.setdefault(name, []):
                            found[name].append(text)
        return {name: "; ".join(texts) for name, texts in found.items()}

    def _statement_checks(self, statement: ast.stmt) -> Iterator[tuple[str, str]]:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            yield from self._call_check(statement.value, {})
        elif isinstance(statement, ast.For) and isinstance(statement.target, ast.Name) \
                and isinstance(statement.iter, ast.Tuple | ast.List):
            names = [e.value for e in statement.iter.elts
                     if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            for inner in statement.body:
                if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call):
                    for name in names:
                        yield from self._call_check(inner.value, {statement.target.id: name})

    def _call_check(self, call: ast.Call, loop: dict[str, str]) -> Iterator[tuple[str, str]]:
        if not isinstance(call.func, ast.Name) or len(call.args) < 2:
            return
        field_name = _field_of(call.args[1], loop)
        if field_name is None:
            return
        check = call.func.id.lstrip("_")  # `positive` (spec.checks), or a module's own alias
        if check == "positive":
            yield field_name, "> 0"
        elif check == "at_least" and len(call.args) >= 3:
            low = self._value(call.args[2])
            if isinstance(low, int | float):
                yield field_name, f"≥ {low:g}"
        elif check == "choice" and len(call.args) >= 3:
            choices = self._value(call.args[2])
            if isinstance(choices, tuple):
                yield field_name, ", ".join(f"`{c}`" for c in choices)

    def _value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            return getattr(self.module, node.id, None)
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None


def _field_of(node: ast.expr, loop: dict[str, str]) -> str | None:
    """`self.name` -> "name"; `getattr(self, var)` inside a loop over names -> that name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "getattr" and len(node.args) == 2 \
            and isinstance(node.args[1], ast.Name):
        return loop.get(node.args[1].id)
    return None


# --- Markdown --------------------------------------------------------------------------------


def _render_table(table: Table, level: str = "##") -> list[str]:
    # a title is a part of the section before it: one level down
    out = [f"{level}# {table.title}", ""] if table.title else [f"{level} `[{table.name}]`", ""]
    if table.doc:
        out += [_md(table.doc), ""]
    out += ["| key | type | default | values | description |", "|---|---|---|---|---|"]
    for k in table.keys:
        default = f"`{k.default}`" if k.default else "*required*"
        out.append(f"| `{k.name}` | {k.type} | {_cell(default)} | {_cell(k.values)} | "
                   f"{_cell(_md(k.doc))} |")
    out.append("")
    return out


def _render_faults() -> list[str]:
    out = [
        "### `failure.faults`",
        "",
        "Faults injected for drills and tests (also from `$SHARDWISE_FAULTS`): a `;`-separated "
        "list of `KIND:KEY=VALUE:KEY=VALUE`, e.g. `kill:rank=1:step=3:phase=backward`. Kinds: "
        + ", ".join(f"`{k}`" for k in failure.KINDS) + "; phases: "
        + ", ".join(f"`{p}`" for p in failure.PHASES)
        + ". What each kind does: [checkpoints.md](checkpoints.md#fault-injection).",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for k in fault_keys():
        if k.name == "kind":
            continue
        out.append(f"| `{k.name}` | {k.type} | `{k.default}` | {_cell(_md(k.doc))} |")
    out.append("")
    return out


def _md(text: str) -> str:
    """Source prose as Markdown: `<name>` outside code spans is text, not an HTML tag (inside a
    code span it already is, and an entity there would show as written)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace(">", "&gt;")
                    for i, part in enumerate(parts))


def _join(parts: list[str]) -> str:
    """Comment pieces as one description: a piece that starts in lower case continues the one
    before it; otherwise the one before it ends a sentence."""
    out = ""
    for part in filter(None, parts):
        if out and not part[0].islower() and out[-1] not in ".;:!?)":
            out += "."
        elif out.endswith(".") and part.split(" ", 1)[0].isalpha() and part[0].islower():
            part = part[0].upper() + part[1:]  # a new sentence
        out = f"{out} {part}" if out else part
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _slug(name: str) -> str:
    """GitHub's anchor of a heading `[name]` in backticks."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.spec.reference",
        description="Write the RunSpec reference (docs/runspec.md) generated from the code.")
    parser.add_argument("--check", metavar="FILE",
                        help="compare FILE with what would be generated; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current != text:
        state = "does not exist" if current is None else "differs from the RunSpec in the code"
        print(f"{path} {state}; regenerate it with `python -m shardwise.spec.reference > {path}`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
