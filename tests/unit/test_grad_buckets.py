"""Gradient buckets that start during backward (parallel/grad_buckets.py), without a process
group: when each bucket starts, in which order, and what waits for `flush`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.parallel.grad_buckets import Bucket, ReadyBuckets, plan_buckets


def test_plan_buckets_keeps_order_and_cap():
    assert plan_buckets([3, 3, 3, 10, 1], cap=6) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([1, 1, 1], cap=100) == [[0, 1, 2]]
    assert plan_buckets([], cap=4) == []


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.unused = nn.Linear(4, 4)  # never in the graph: no gradient arrives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).tanh()
        return x.sum()


def _buckets(model: Chain, log: list[str], groups: dict[str, list[nn.Parameter]]) -> list[Bucket]:
    return [Bucket(params, lambda name=name: log.append(name)) for name, params in groups.items()]


def test_buckets_start_in_backward_in_order_once_ready():
    model, log = Chain(), []
    last, middle, first = (list(m.parameters()) for m in model.layers[::-1])
    ready = ReadyBuckets(_buckets(model, log, {"last": last, "middle": middle, "first": first}))
    ready.arm(2)
    model(torch.randn(2, 4)).backward()
    assert log == []  # one of two micro-batches: nothing is final yet
    marks = []
    # the gradient of the first layer's output arrives before that layer's own backward
    def mark_when_reached(_module, _inputs, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: marks.append(list(log)))

    model.layers[0].register_forward_hook(mark_when_reached)
    model(torch.randn(2, 4)).backward()
    # when the first layer's backward began, the two later layers' buckets had already started
    assert marks == [["last", "middle"]]
    assert log == ["last", "middle", "first"] and ready.early == 3
    ready.flush()
    assert log == ["last", "middle", "first"]  # nothing started twice


def test_a_bucket_that_is_not_ready_holds_back_the_ones_after_it():
    model, log = Chain(), []
    unused = list(model.unused.parameters())
    last, middle, first = (list(m.parameters()) for m in model.layers[::-1])
    ready = ReadyBuckets(_buckets(model, log, {"last": last, "unused": unused + middle,
                                               "first": first, "late": []}))
    ready.arm(1)
    model(torch.randn(2, 4)).backward()
    assert log == ["last"]  # "unused" never completes, "first" must not overtake it
    ready.flush()
    assert log == ["last", "unused", "first", "late"] and ready.early == 1


def test_a_gradient_after_the_start_marks_the_bucket_stale():
    model, log = Chain(), []
    groups = {"all": [p for m in model.layers for p in m.parameters()]}
    buckets = _buckets(model, log, groups)
    ready = ReadyBuckets(buckets)
    ready.arm(1)
    model(torch.randn(2, 4)).backward()
    assert log == ["all"] and not buckets[0].stale
    model(torch.randn(2, 4)).backward()  # one more than armed for
    assert buckets[0].stale and log == ["all"]
    ready.arm(1)  # the next step starts clean
    assert not buckets[0].stale and not buckets[0].started


@pytest.mark.parametrize("armed", [False, True])
def test_unarmed_buckets_start_only_at_flush(armed):
    model, log = Chain(), []
    ready = ReadyBuckets(_buckets(model, log, {"all": list(model.layers.parameters())}))
    if armed:
        ready.arm(1)
    model(torch.randn(2, 4)).backward()
    assert log == (["all"] if armed else [])
    ready.flush()
    assert log == ["all"]
