"""The loss is shardwise's: the sum of per-target losses over the step's global count of real
targets, so micro-batching never changes the objective.

Two micro-batches of very different real lengths (one nearly all padding, ignore index -100):
the accumulated gradient equals the gradient of the same samples as one batch — and differs, by
far more than rounding, from the mean of per-micro-batch means, which weights the two short
targets as much as the 60 long ones. Also under DDP at world 2, with the ranks holding the
unequal halves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardwise.models import build_model
from shardwise.models.plan import IGNORE_INDEX, plan_of
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.execution import ParallelModel
from shardwise.parallel.parallelize import apply_ddp
from shardwise.run.step import real_targets
from shardwise.spec.layout import ParallelSection
from shardwise.spec.model import ModelSection
from tests.support.ranks import run_ranks

VOCAB, SEQ = 64, 16


def _model() -> torch.nn.Module:
    return build_model(ModelSection.of(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                                    ffn_hidden=64), VOCAB, SEQ, seed=3)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    short = y[2:].clone()
    short[:, 1:] = IGNORE_INDEX  # one real target per sequence: 2 in the micro-batch
    long_ = y[:2].clone()
    long_[:, -2:] = IGNORE_INDEX  # 14 real targets per sequence: 28
    return [(x[:2], long_), (x[2:], short)]


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _single() -> ParallelModel:
    dims = ParallelDims.from_spec(ParallelSection(nproc=1), 1)
    ctx = DistContext(0, 0, 1, 1, torch.device("cpu"), dims, None)
    model = _model()
    return ParallelModel([model], ctx, "fp32", plan_of(model))


def test_uneven_micro_batches_give_the_one_batch_gradient_and_not_the_mean_of_means():
    batches = _batches()
    pm = _single()
    count = real_targets(pm, batches)
    assert count.item() == 30
    pm.forward_backward(batches, loss_scale=1.0 / count.item())
    accumulated = _grads(pm.parts[0])

    whole = _model()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(whole(x).flatten(0, 1), y.flatten(), reduction="mean").backward()
    one_batch = _grads(whole)
    torch.testing.assert_close(accumulated, one_batch, rtol=1e-5, atol=1e-7)

    means = _model()
    for xb, yb in batches:  # what a per-micro-batch mean loss optimises
        (F.cross_entropy(means(xb).flatten(0, 1), yb.flatten()) / len(batches)).backward()
    off = (_grads(means) - one_batch).norm() / one_batch.norm()
    assert off > 0.1, f"mean of means should be far off; it is {off:.2e}"


def _ddp(store: Any) -> list[float]:
    from shardwise.parallel.distributed import init_distributed, shutdown

    ctx = init_distributed(ParallelSection(nproc=2, dp_replicate=2, dp_shard=1, timeout_s=60),
                           store)
    try:
        model = _model()
        pm = ParallelModel([apply_ddp(model, ctx.dp_group(), ctx.device)], ctx, "fp32",
                           plan_of(model))
        mine = [_batches()[ctx.rank]]  # rank 0 the long micro-batch, rank 1 the short one
        count = real_targets(pm, mine)
        pm.forward_backward(mine, loss_scale=1.0 / count.item())
        return [count.item(), *_grads(pm.parts[0].module).tolist()]
    finally:
        shutdown()


def test_ddp_ranks_with_unequal_real_targets_give_the_one_batch_gradient():
    batches = _batches()
    whole = _model()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(whole(x).flatten(0, 1), y.flatten(), reduction="mean").backward()
    for r in run_ranks(_ddp, 2, timeout=120):
        assert r[0] == 30  # the global count, on both ranks
        torch.testing.assert_close(torch.tensor(r[1:]), _grads(whole), rtol=1e-5, atol=1e-7)
