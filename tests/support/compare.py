"""Assertions that compare a run with its reference: parameters, losses, bitwise state."""

from __future__ import annotations

import hashlib

import torch


def assert_model_close(got: dict, want: dict, rtol: float, atol_max: float = 1e-4) -> None:
    """The whole parameter vector: ||got - want|| <= rtol * ||want|| over all tensors together,
    and no single element off by more than `atol_max` (AdamW can push one element whose gradient
    is almost zero further than the rest; this bounds it)."""
    assert got.keys() == want.keys()
    diff = sum((got[k] - want[k]).double().pow(2).sum() for k in want).sqrt().item()
    ref = sum(want[k].double().pow(2).sum() for k in want).sqrt().item()
    worst = max(want, key=lambda k: (got[k] - want[k]).abs().max().item())
    worst_abs = (got[worst] - want[worst]).abs().max().item()
    assert diff <= rtol * ref, f"||diff|| {diff:.3e} > {rtol} * ||ref|| {ref:.3e}; worst {worst}"
    assert worst_abs <= atol_max, f"{worst}: max |diff| {worst_abs:.3e} > {atol_max}"


def assert_ranks_match_reference(results: list[dict], reference: dict) -> None:
    """Every rank reports the reference's global losses (1e-5) and gradient norms (1e-4: the
    norm is a long reduction whose rounding differs more, seen 1.5e-5), and rank 0's parameters
    match the reference's as a whole vector (1e-5)."""
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]),
                                   torch.tensor(reference["grad_norms"]), rtol=1e-4, atol=0)
    assert_model_close(results[0]["params"], reference["params"], rtol=1e-5)


def assert_params_close(got: dict, want: dict, rtol: float) -> None:
    """Per tensor: ||got - want|| <= rtol * ||want|| (L2 over all elements)."""
    assert got.keys() == want.keys()
    for name in want:
        diff = (got[name] - want[name]).norm().item()
        scale = want[name].norm().item()
        assert diff <= rtol * scale, (
            f"{name}: ||diff|| {diff:.3e} > {rtol} * ||ref|| {scale:.3e} "
            f"(max |diff| {(got[name] - want[name]).abs().max().item():.3e})")


def state_sha256(result: dict) -> str:
    h = hashlib.sha256()
    for group in ("params", "optim"):
        for key in sorted(result[group]):
            t = result[group][key].contiguous()
            h.update(key.encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()
