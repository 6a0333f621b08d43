"""The RunSpec: one typed, frozen description of a training run.

Every section is a frozen dataclass, defined by topic — `spec/training.py` (run, data, batch,
optimizer, loss scale, eval, sample), `spec/layout.py` (parallel, memory), `spec/operations.py`
(failure, checkpoint, log, telemetry, fit), `spec/model.py` ([model] and its families) — and
`validate()` checks each value on its own and then the values that must fit together. Topology
checks that need the world size live in `shardwise.parallel.dims`, because the world size is only
known at launch. The sections are importable from here too (the RunSpec's own vocabulary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.layout import MemorySection, ParallelSection
from shardwise.spec.model import ModelSection
from shardwise.spec.operations import (
    CheckpointSection,
    FailureSection,
    FitSection,
    LogSection,
    TelemetrySection,
)
from shardwise.spec.secrets import check_no_credentials
from shardwise.spec.training import (
    BatchSection,
    DataSection,
    EvalSection,
    LossScaleSection,
    OptimizerSection,
    RunSection,
    SampleSection,
)
from shardwise.utils.paths import is_within

__all__ = ["BatchSection", "CheckpointSection", "DataSection", "EvalSection", "FailureSection",
           "FitSection", "LogSection", "LossScaleSection", "MemorySection", "ModelSection",
           "OptimizerSection", "ParallelSection", "RunSection", "RunSpec", "SampleSection",
           "TelemetrySection"]


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
