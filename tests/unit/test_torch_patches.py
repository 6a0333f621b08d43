"""Every change shardwise makes to torch goes through one `TorchPatches`, and leaving it puts torch
back as it was — after a run, after a failure in the middle of one, with the comm tap and the
meta-device build both having patched it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.compat import TorchPatches, functional_collectives
from shardwise.models.deferred import record_build
from shardwise.telemetry.comm.tap import CommTap


def torch_state() -> dict[str, int]:
    """Identities of everything the tap or the build could replace process-wide."""
    funcol = functional_collectives()
    from torch.distributed import distributed_c10d as c10d

    state = {f"Tensor.{k}": id(v) for k, v in vars(torch.Tensor).items()}
    for prefix, module in (("dist", dist), ("c10d", c10d), ("funcol", funcol)):
        state.update({f"{prefix}.{k}": id(v) for k, v in vars(module).items() if callable(v)})
    return state


def tapped() -> bool:
    return bool(getattr(dist.all_reduce, "__shardwise_tap__", False))


def test_a_failed_run_leaves_torch_unpatched() -> None:
    before = torch_state()
    seen_inside: dict[str, bool] = {}

    def build() -> nn.Module:
        seen_inside["is_meta patched"] = "is_meta" in vars(torch.Tensor)
        return nn.Linear(3, 4)

    with pytest.raises(RuntimeError, match="mid-run"), TorchPatches() as patches:
        _, record = record_build(build, patches)
        assert record.deferred and seen_inside["is_meta patched"]
        assert "is_meta" not in vars(torch.Tensor)  # the build's scope ended with the build
        tap = CommTap({}).install(patches)
        assert tapped()
        assert len(patches) > 0 and tap is not None
        raise RuntimeError("mid-run")  # the tap is never uninstalled by its owner
    assert torch_state() == before


def test_uninstalling_the_tap_restores_only_its_own_patches() -> None:
    before = torch_state()
    with TorchPatches() as patches:
        patches.set(torch.Tensor, "shardwise_probe", 1)
        tap = CommTap({}).install(patches)
        with pytest.raises(RuntimeError, match="already installed"):
            CommTap({}).install(patches)
        tap.uninstall()
        assert not tapped()
        assert torch.Tensor.shardwise_probe == 1  # type: ignore[attr-defined]
    assert torch_state() == before


def test_without_a_runtime_each_keeps_a_scope_of_its_own() -> None:
    before = torch_state()
    record_build(lambda: nn.Linear(2, 2))
    CommTap({}).install().uninstall()
    assert torch_state() == before
