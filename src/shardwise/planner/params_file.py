"""`CostParams` as a TOML file with one `[cost_params]` table: what `shardwise plan --calibrate
--write-params FILE` writes and `--params FILE` reads, each value checked."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from shardwise.errors import SpecError, UserError
from shardwise.planner.cost import OVERHEAD_FIELDS, OVERLAPPABLE, CostParams
from shardwise.planner.dispatch import DISPATCHERS, ROUTINGS
from shardwise.planner.params import PP_SPLITS

PARAMS_TABLE = "cost_params"


def validate_params(params: CostParams, origin: str = "the cost parameters",
                    table: str = PARAMS_TABLE) -> CostParams:
    """Refuse values the cost model cannot use, naming the field (as `table`.field)."""
    def bad(name: str, want: str) -> SpecError:
        return SpecError(f"{table}.{name} = {getattr(params, name)!r} in {origin}: it must "
                         f"be {want}.")

    if not 0 < params.efficiency <= 1:
        raise bad("efficiency", "in (0, 1]")
    for name in ("overlap", "fsdp_overlap", "bandwidth_efficiency", "tp_overlap", "ep_overlap"):
        value = getattr(params, name)
        if not 0 <= value <= 1:
            raise bad(name, "in [0, 1]")
    if params.bandwidth_efficiency == 0:
        raise bad("bandwidth_efficiency", "above 0")
    for name in ("collective_latency_s", "fragmentation", "runtime_overhead_bytes",
                 "logits_bytes", "cpu_runtime_overhead_bytes", "cpu_fragmentation",
                 "cpu_zero1_retained_copies", "cpu_fsdp_retained_copies", "step_host_s",
                 *OVERHEAD_FIELDS):
        value = getattr(params, name)
        if not (value >= 0 and math.isfinite(value)):
            raise bad(name, "a finite number of at least 0")
    if params.pipeline_local_batch < 0:
        raise bad("pipeline_local_batch", "0 (the step's micro-batches in one pipeline call) or "
                  "the sequences per data-parallel rank of one call")
    if params.residual_bytes not in (2, 4):
        raise bad("residual_bytes", "2 (bf16) or 4 (fp32)")
    if params.grad_bytes not in (2, 4):
        raise bad("grad_bytes", "2 (fp16/bf16) or 4 (fp32)")
    for name in ("gemm_efficiency_ampere", "gemm_efficiency_hopper",
                 "attention_efficiency_ampere", "attention_efficiency_hopper"):
        if not 0 < getattr(params, name) <= 1:
            raise bad(name, "in (0, 1]")
    for name in ("gemm_k_half_ampere", "gemm_k_half_hopper"):
        if not (getattr(params, name) >= 0 and math.isfinite(getattr(params, name))):
            raise bad(name, "a finite number of at least 0")
    for name, choices in (("ep_dispatch", DISPATCHERS), ("ep_routing", ROUTINGS)):
        if getattr(params, name) not in choices:
            raise bad(name, " or ".join(f'"{x}"' for x in choices))
    if params.pp_split not in PP_SPLITS:
        raise bad("pp_split", " or ".join(f'"{x}"' for x in PP_SPLITS))
    unknown = [x for x in params.overlapped if x not in OVERLAPPABLE]
    if unknown:
        raise bad("overlapped", f"a list of {', '.join(OVERLAPPABLE)} (not {', '.join(unknown)})")
    return params


def params_to_toml(params: CostParams, header: Sequence[str] = ()) -> str:
    from shardwise.spec.toml import toml_value as _toml_value

    lines = [f"# {line}" for line in header]
    lines.append(f"[{PARAMS_TABLE}]")
    lines.extend(f"{f.name} = {_toml_value(getattr(params, f.name))}"
                 for f in dataclasses.fields(CostParams))
    return "\n".join(lines) + "\n"


def load_params(path: str | Path) -> CostParams:
    """CostParams from a TOML file with one `[cost_params]` table (as `--write-params` writes it;
    keys left out keep their defaults)."""
    from shardwise.spec.toml import build_table as _build_section
    from shardwise.spec.toml import read_toml as _read_toml
    from shardwise.spec.toml import suggest as _suggest

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--params {path}: no such file. Pass a TOML file that `shardwise plan "
                        "--calibrate RUN_DIR --write-params FILE` wrote.")
    data = _read_toml(path)
    unknown = [k for k in data if k != PARAMS_TABLE]
    if unknown or not isinstance(data.get(PARAMS_TABLE, {}), dict):
        name = unknown[0] if unknown else PARAMS_TABLE
        raise SpecError(f"{path}: [{name}] is not a table of cost parameters."
                        f"{_suggest(name, [PARAMS_TABLE])} The file holds one [{PARAMS_TABLE}] "
                        "table (as --write-params writes it).")
    table = data.get(PARAMS_TABLE, {})
    refuse_renamed(table, f"{path}: [{PARAMS_TABLE}]")
    params = _build_section(PARAMS_TABLE, CostParams, table, str(path))
    return validate_params(params, str(path))


#: CostParams fields that were renamed, and what they say now
RENAMED = {"eager_activations": ("eager_modules", "it now also times the eager modules' "
                                 "elementwise kernels, not only their saved tensors")}


def refuse_renamed(values: dict, where: str) -> None:
    """A key an older shardwise wrote, named with what replaced it (a close-match suggestion
    would point elsewhere)."""
    for old, (new, why) in RENAMED.items():
        if old in values:
            raise SpecError(f"{where}: {old} was renamed {new} ({why}). Rename the key; the "
                            "value means the same.")
