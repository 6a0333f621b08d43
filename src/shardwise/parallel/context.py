"""Context parallel: every sequence split over the `cp` ranks, attention as ring attention.

Load balancing (zigzag): a sequence of T tokens is cut into 2N chunks of c = T / 2N; cp rank r
holds chunks r and 2N-1-r. Under a causal mask an early chunk attends little and a late chunk
much, so every rank gets one of each and the same attention work.

Ring attention itself (`parallel.ring_attention`): each rank computes its queries against its
own K/V block, then against every other rank's as the blocks travel around the ring (or are
all-gathered at once with `parallel.cp_comm = "allgather"`); exact backward.

The model side is the plan's `attention` entry: modules matching it compute their attention core
through `module.attention_fn(q, k, v)` (causal; q (B, H, T, D), k/v (B, H_kv, T, D) unrepeated);
`apply_context_parallel` replaces that attribute. The replacement runs ring attention only inside
`ContextParallel.active()` — the trainer's sharded forward and backward (and recomputation under
activation checkpointing) — and the module's own function otherwise (generation, where every
rank runs the whole prompt).

Modules whose forward needs a statistic of the whole sequence (an MoE router's load-balancing
loss counts assignments over every token of the micro-batch; capacity routing drops by the whole
micro-batch's token order) declare a method `shardwise_sequence_split(split)`; it is given a
`SequenceSplit`: called, it sums a tensor over the cp group (an all-reduce; every cp rank calls it
in the same forward); it also gathers a tensor from every cp rank and numbers this rank's tokens
in the whole sequence.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import SpecError
from shardwise.models.plan import ModelPlan
from shardwise.parallel.ring_attention import CPGroup, ring_attention
from shardwise.spec.layout import CP_COMMS

__all__ = ["CP_COMMS", "CPGroup", "ContextParallel", "SequenceSplit", "apply_context_parallel",
           "ring_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard"]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ATTENTION_ATTR = "attention_fn"
SEQUENCE_HOOK = "shardwise_sequence_split"


# --- zigzag layout ---------------------------------------------------------------------------
def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None
                     ) -> torch.Tensor:
    """True positions (int64, length seq_len / cp) of the tokens cp rank `rank` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len {seq_len} is not a multiple of 2 * cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of `x` (full sequence along `dim`) that cp rank `rank` holds."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's `zigzag_shard` part (rank order)."""
    n = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[r][0] for r in range(n)] + [halves[r][1] for r in reversed(range(n))]
    return torch.cat(ordered, dim=dim)




# --- applying it to a model ---------------------------------------------------------------------
@dataclass
class ContextParallel:
    """What the trainer needs to run a model under context parallel: the cp group, whether the
    swapped attention runs as ring attention now, and the split of a batch."""

    cp: CPGroup
    positions_arg: str
    hidden_seq_split: int = 1  # tp under sequence parallel: hidden states' share of the sequence
    _active: bool = False
    _positions: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Ring attention in the swapped modules (forward, backward and any recompute)."""
        before, self._active = self._active, True
        try:
            yield
        finally:
            self._active = before

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's zigzag chunks of tokens and targets (B, T) and the keyword argument that
        gives the model their true positions (cached per length and device)."""
        return (zigzag_shard(inputs, self.cp.size, self.cp.rank),
                zigzag_shard(targets, self.cp.size, self.cp.rank),
                {self.positions_arg: self.positions(inputs.shape[1], inputs.device)})

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The true positions of this rank's zigzag chunks of a sequence of `seq_len`."""
        key = (seq_len, str(device))
        if key not in self._positions:
            self._positions[key] = zigzag_positions(seq_len, self.cp.size, self.cp.rank, device)
        return self._positions[key]

    def stage_positions(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A forward pre-hook for pipeline stages: under pipeline parallel a stage gets only the
        previous stage's hidden states, so each stage supplies its tokens' positions itself —
        a function of the sequence length and this rank's cp coordinate, the same for every
        micro-batch, so nothing needs to travel with the hidden states."""
        if self._active and self.positions_arg not in kwargs and args:
            x = args[0]
            # token ids (the first stage) hold this rank's whole zigzag share of the sequence;
            # hidden states between stages may be split over tp too (sequence parallel)
            local = x.shape[1] * (1 if not x.is_floating_point() else self.hidden_seq_split)
            kwargs = {**kwargs, self.positions_arg: self.positions(local * self.cp.size, x.device)}
        return args, kwargs

    def wrap(self, original: AttentionFn) -> AttentionFn:
        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self._active:
                return ring_attention(q, k, v, self.cp)
            return original(q, k, v)
        attention.__qualname__ = f"ring_attention[{original.__qualname__}]"
        return attention


@dataclass
class SequenceSplit:
    """What a module that needs the whole sequence receives through `shardwise_sequence_split`.
    Called, it sums a tensor over the cp ranks (an all-reduce, in place); `gather` stacks one
    tensor per cp rank; `token_index` numbers this rank's tokens in the whole micro-batch's order;
    `active` is whether the sequence is split now (the trainer's forward and backward, and its
    evaluation; not generation, where every rank runs the whole prompt)."""

    context: ContextParallel

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.context.cp.group)
        return t

    @property
    def active(self) -> bool:
        return self.context._active

    @property
    def rank(self) -> int:
        return self.context.cp.rank

    @property
    def size(self) -> int:
        return self.context.cp.size

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(cp, *t.shape): every cp rank's `t` (same shape on all), in cp rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.context.cp.group)
        return torch.stack(out)

    def token_index(self, rows: int, local_len: int, device: torch.device) -> torch.Tensor:
        """(rows * local_len,) int64: where each of this rank's tokens (rows of `local_len`
        zigzag-local tokens, flattened row-major) sits in the flattened whole micro-batch."""
        whole = local_len * self.size
        positions = self.context.positions(whole, device)
        return (torch.arange(rows, device=device).unsqueeze(1) * whole + positions).reshape(-1)


def attention_modules(model: nn.Module, plan: ModelPlan) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if m is not None and plan.attention and fnmatch.fnmatchcase(name, plan.attention)]


def apply_context_parallel(parts: Sequence[nn.Module], plan: ModelPlan,
                           group: dist.ProcessGroup | None, rank: int, size: int,
                           comm: str) -> ContextParallel:
    """Swap the attention core of every module the plan's `attention` entry matches, in every
    part (pipeline stages: each also supplies its positions, `stage_positions`), for ring
    attention over the cp group (in place); refuse a model whose attention cannot be swapped."""
    modules = [m for part in parts for m in attention_modules(part, plan)]
    lacking = [name for name, m in modules if not callable(getattr(m, ATTENTION_ATTR, None))]
    if not modules or lacking:
        raise SpecError(
            f"context parallel replaces the attention core of the modules the model's plan names "
            f"in `attention` ({plan.attention!r}), but "
            + (f"{lacking[:3]} have no `{ATTENTION_ATTR}(q, k, v)`" if lacking else
               "no module matches it")
            + f". Use parallel.cp = 1, or give those modules an `{ATTENTION_ATTR}` attribute "
            "(causal attention of q (B, H, T, D), k/v (B, H_kv, T, D)) that they call.")
    context = ContextParallel(CPGroup(group, rank, size, comm), plan.positions)
    for _, module in modules:
        setattr(module, ATTENTION_ATTR, context.wrap(getattr(module, ATTENTION_ATTR)))

    split = SequenceSplit(context)
    for part in parts:
        for module in part.modules():
            hook = getattr(module, SEQUENCE_HOOK, None)
            if callable(hook):
                hook(split)
        # (a no-op where the caller passes the positions: the model whole, not a stage)
        part.register_forward_pre_hook(context.stage_positions, with_kwargs=True)
    return context
