"""Tied tensors under pipeline parallel: one tensor, held by more than one stage.

A model that ties its input embedding to its output projection has one tensor used by the first
and the last stage; a pipeline split gives each of those stages its own copy. The copies start
equal (every stage is cut from the same model) and stay equal if every copy gets the same
gradient: the sum of the gradients of all uses, which is the single-process gradient. So after
backward the copies' gradients are summed (all-reduced over the pp ranks that hold them, at the
same data- and tensor-parallel coordinates, so the local shards line up; added locally when one
rank holds two, as the zero-bubble V places the first and last stages on rank 0). Each copy then
takes the same optimizer step. Only one copy counts in the gradient norm; the others are
`mirrors`, and checkpoints name every copy's optimizer state by the group's first name.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.models.plan import ModelPlan
from shardwise.parallel.data_parallel import unwrap
from shardwise.parallel.distributed import DistContext


@dataclass
class _Group:
    names: tuple[str, ...]  # the tied names, canonical first
    held: list[tuple[int, str]]  # (part index, name) of this rank's copies
    process_group: dist.ProcessGroup | None  # pp ranks holding copies; None: only this one
    params: list[nn.Parameter] = field(default_factory=list)
    counts_here: bool = False  # this rank holds the copy the gradient norm counts


@dataclass
class TiedAcrossStages:
    groups: list[_Group]
    mirrors: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, parts: list[nn.Module], ids: list[int], n_stages: int, plan: ModelPlan,
              ctx: DistContext) -> TiedAcrossStages:
        """Collective over the world (process groups are created by every rank in one order)."""
        assert ctx.mesh is not None  # pipeline parallel (pp > 1) runs on a mesh
        pp_mesh = ctx.mesh["pp"]
        mine = {}
        for group in plan.tied:
            held = [(i, name) for i, part in enumerate(parts) for name in group
                    if _has_param(part, name)]
            mine[group] = held
        every: list[dict | None] = [None] * pp_mesh.size()
        dist.all_gather_object(every, {g: bool(h) for g, h in mine.items()},
                               group=pp_mesh.get_group())
        me = pp_mesh.get_local_rank()
        groups = []
        cache: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for tied in plan.tied:
            # (every entry filled by all_gather_object)
            holders = tuple(r for r, have in enumerate(cast(list[dict], every)) if have[tied])
            pg = None
            if len(holders) > 1:
                if holders not in cache:
                    cache[holders] = _new_groups_over_pp(ctx, holders)
                pg = cache[holders]
            if len(holders) > 1 or len(mine[tied]) > 1:
                groups.append(_Group(tied, mine[tied], pg if me in holders else None,
                                     counts_here=bool(holders) and me == holders[0]))
        return cls([g for g in groups if g.held])

    def resolve(self, parts: list[nn.Module]) -> None:
        """Look the copies up on the final (data-parallel wrapped) parts."""
        self.mirrors = set()
        for group in self.groups:
            group.params = [unwrap(parts[i]).get_parameter(name) for i, name in group.held]
            for k, p in enumerate(group.params):
                if k > 0 or not group.counts_here:
                    self.mirrors.add(id(p))

    def aliases(self, part_index: int) -> dict[str, str]:
        """name of a copy in part `part_index` -> the group's canonical name."""
        return {name: group.names[0] for group in self.groups
                for i, name in group.held if i == part_index and name != group.names[0]}

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Every copy's gradient := the sum over all copies (after backward, before the norm)."""
        for group in self.groups:
            grads = [p.grad for p in group.params]
            if any(g is None for g in grads):
                raise RuntimeError(f"a copy of the tied tensor {group.names} got no gradient")
            locals_ = [_local(g) for g in cast(list[torch.Tensor], grads)]  # none is None (above)
            total = locals_[0] if len(locals_) == 1 else torch.stack(locals_).sum(0)
            if group.process_group is not None:
                total = total.contiguous()
                dist.all_reduce(total, group=group.process_group)
            for t in locals_:
                t.copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _has_param(part: nn.Module, name: str) -> bool:
    try:
        part.get_parameter(name)
    except AttributeError:
        return False
    return True


def _new_groups_over_pp(ctx: DistContext, holders: tuple[int, ...]) -> dist.ProcessGroup | None:
    """One process group per coordinate of the other mesh axes, over the pp ranks `holders`;
    every rank creates all of them (in the same order) and keeps the one it belongs to."""
    mesh = ctx.mesh
    assert mesh is not None  # called by TiedAcrossStages.build, under pipeline parallel
    assert mesh.mesh_dim_names is not None  # build_mesh names every axis
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index("pp"), 0)  # (pp, the other axes...)
    others = grid.shape[1:]
    mine = None
    for index in itertools.product(*(range(n) for n in others)):
        ranks = [int(grid[(h, *index)]) for h in holders]
        pg = dist.new_group(ranks=ranks)
        if ctx.rank in ranks:
            mine = pg
    return mine
