"""Context parallel: every sequence split over the `cp` ranks, attention as ring attention.

Load balancing (zigzag): a sequence of T tokens is cut into 2N chunks of c = T / 2N; cp rank r
holds chunks r and 2N-1-r. Under a causal mask an early chunk attends little and a late chunk
much, so every rank gets one of each and the same attention work.

Ring attention (`ring_attention`, our own autograd function on torch.distributed primitives):
each rank computes its queries against its own K/V block, then against the K/V block of each
other rank as the blocks travel around the ring (`batch_isend_irecv` to the next rank, from the
previous one; the next block is in flight while the current one is computed). Partial outputs
merge by the log-sum-exp rule. Backward is exact: dQ stays local, dK/dV accumulate in buffers
that travel around the ring with their K/V block and arrive home after N hops. With
`parallel.cp_comm = "allgather"` every rank gathers all K/V blocks at once instead (one
collective, N x the K/V memory) and reduce-scatters dK/dV back. Only the K/V heads travel — under
grouped-query attention each K/V head serves its group of query heads on the receiving rank.

Per block pair (queries of chunks {r, 2N-1-r}, keys of source rank s's chunks {s, 2N-1-s}), the
causal mask follows the true positions, which reduces to three cases:
  s == r: causal over the rank's own two chunks (positions increase along the local sequence);
  s < r:  every query sees the source's first chunk, none of its second;
  s > r:  only the second query chunk sees anything, and then both source chunks.
Block arithmetic is fp32 (softmax statistics and dK/dV accumulators), whatever the autocast.

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
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import SpecError
from shardwise.models.plan import ModelPlan
from shardwise.parallel.collectives import all_gather_flat, reduce_scatter_flat
from shardwise.spec.layout import CP_COMMS

__all__ = ["CP_COMMS", "CPGroup", "ContextParallel", "SequenceSplit", "apply_context_parallel",
           "ring_attention", "zigzag_positions", "zigzag_shard", "zigzag_unshard"]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ATTENTION_ATTR = "attention_fn"
SEQUENCE_HOOK = "shardwise_sequence_split"
_KV_TAG, _DKV_TAG = 1, 2


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


# --- the cp group ------------------------------------------------------------------------------
@dataclass
class CPGroup:
    """The cp process group and where this rank sits in it; counts the bytes it sends."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    comm: str = "ring"
    sent_bytes: int = 0  # K/V and dK/dV bytes this rank sent (or contributed to collectives)

    @functools.cached_property
    def next_peer(self) -> int:
        return dist.get_global_rank(cast(dist.ProcessGroup, self.group), (self.rank + 1) % self.size)

    @functools.cached_property
    def prev_peer(self) -> int:
        return dist.get_global_rank(cast(dist.ProcessGroup, self.group), (self.rank - 1) % self.size)

    def start_shift(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list]:
        """Send `send` to the next rank and receive the previous rank's into a new buffer
        (posted, not waited for). K/V and dK/dV hops use different tags: both may be in flight
        between the same two ranks (gloo matches messages by peer and tag)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next_peer, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev_peer, self.group, tag)]
        self.sent_bytes += send.numel() * send.element_size()
        return recv, dist.batch_isend_irecv(ops)

    def shift(self, send: torch.Tensor, tag: int = 0) -> torch.Tensor:
        recv, works = self.start_shift(send, tag)
        _wait(works)
        return recv

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """(size, *local.shape): every rank's `local`, in rank order."""
        out = local.new_empty((self.size, *local.shape))
        all_gather_flat(out.view(-1), local.contiguous().view(-1), self.group)
        self.sent_bytes += local.numel() * local.element_size() * (self.size - 1)
        return out

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        """Rank r's slice r of the sum over ranks of `full` (size, ...)."""
        out = full.new_empty(full.shape[1:])
        reduce_scatter_flat(out.view(-1), full.contiguous().view(-1), self.group)
        self.sent_bytes += out.numel() * out.element_size() * (self.size - 1)
        return out


def _wait(works: list) -> None:
    for work in works:
        work.wait()


# --- block arithmetic (fp32) --------------------------------------------------------------------
def _pairing(rank: int, src: int, t: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of this rank's queries against rank `src`'s K/V, both
    zigzag-local sequences of length t (see the module docstring)."""
    half = t // 2
    if src == rank:
        return slice(0, t), slice(0, t), True
    if src < rank:
        return slice(0, t), slice(0, half), False
    return slice(half, t), slice(0, t), False


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q (B, Hkv, g, tq, D) against k (B, Hkv, tk, D) -> (B, Hkv, g, tq, tk), masked."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.unsqueeze(2))
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones for `rows`, in place."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    old_out.mul_(torch.exp(old_lse - new_lse).unsqueeze(-1))
    old_out.add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    old_lse.copy_(new_lse)


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, causal: bool, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of one block given the final log-sum-exp and delta = rowsum(dO * O)."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, H_kv, H/H_kv, T, D), fp32: query head h uses K/V head h // group (the
    pairing `repeat_interleave` gives)."""
    b, h, t, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, t, d)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cp: CPGroup) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            b, h, t, d = q.shape
            scale = 1.0 / math.sqrt(d)
            qg = _grouped(q, k.shape[1])
            out = torch.zeros_like(qg)
            lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
            for src, kv in _kv_blocks(cp, torch.stack([k, v])):
                rows, cols, causal = _pairing(cp.rank, src, t)
                blk_out, blk_lse = _block_forward(qg[..., rows, :], kv[0][..., cols, :].float(),
                                                  kv[1][..., cols, :].float(), causal, scale)
                _merge(out, lse, rows, blk_out, blk_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out.reshape(b, h, t, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp: CPGroup = ctx.cp
        with torch.autocast(q.device.type, enabled=False):
            b, h, t, d = q.shape
            scale = 1.0 / math.sqrt(d)
            qg = _grouped(q, k.shape[1])
            dog = _grouped(dout, k.shape[1])
            delta = (dog * out).sum(-1)
            dq = torch.zeros_like(qg)
            kv = torch.stack([k, v])
            dkv = _backward_ring(cp, kv, qg, dog, lse, delta, dq, scale) if cp.comm == "ring" \
                else _backward_allgather(cp, kv, qg, dog, lse, delta, dq, scale)
        return (dq.reshape(b, h, t, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None)


def _kv_blocks(cp: CPGroup, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(source rank, its K/V) for every rank of the group, starting with this one's; the ring
    variant posts the next hop before handing out the current block."""
    if cp.comm == "allgather":
        gathered = cp.all_gather(kv)
        for step in range(cp.size):
            src = (cp.rank - step) % cp.size
            yield src, gathered[src]
        return
    kv = kv.contiguous()
    for step in range(cp.size):
        pending = cp.start_shift(kv, _KV_TAG) if step < cp.size - 1 else None
        yield (cp.rank - step) % cp.size, kv
        if pending is not None:
            kv, works = pending
            _wait(works)


def _block_grads(cp: CPGroup, src: int, kv: torch.Tensor, qg: torch.Tensor, dog: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dkv: torch.Tensor,
                 scale: float) -> None:
    """Add one block's dQ (local) and dK/dV (into `dkv`, the source's buffer)."""
    rows, cols, causal = _pairing(cp.rank, src, qg.shape[-2])
    bdq, bdk, bdv = _block_backward(qg[..., rows, :], kv[0][..., cols, :].float(),
                                    kv[1][..., cols, :].float(), dog[..., rows, :],
                                    lse[..., rows], delta[..., rows], causal, scale)
    dq[..., rows, :] += bdq
    dkv[0][..., cols, :] += bdk
    dkv[1][..., cols, :] += bdv


def _backward_ring(cp: CPGroup, kv: torch.Tensor, qg: torch.Tensor, dog: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """K/V travel around the ring again; each block's dK/dV buffer travels with it, collecting
    every rank's contribution, and one more hop brings it home."""
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for src, block in _kv_blocks(cp, kv):
        _block_grads(cp, src, block, qg, dog, lse, delta, dq, dkv, scale)
        dkv = cp.shift(dkv, _DKV_TAG) if cp.size > 1 else dkv
    return dkv


def _backward_allgather(cp: CPGroup, kv: torch.Tensor, qg: torch.Tensor, dog: torch.Tensor,
                        lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                        scale: float) -> torch.Tensor:
    dkv = torch.zeros((cp.size, *kv.shape), dtype=torch.float32, device=kv.device)
    for src, block in _kv_blocks(cp, kv):
        _block_grads(cp, src, block, qg, dog, lse, delta, dq, dkv[src], scale)
    return cp.reduce_scatter(dkv)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """Causal attention of zigzag-local q (B, H, T/N, D) against the whole sequence's keys,
    k/v (B, H_kv, T/N, D) being this rank's share; returns this rank's output (B, H, T/N, D)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    if q.shape[-2] % 2:
        raise ValueError(f"a zigzag-local sequence has two equal chunks; got {q.shape[-2]} tokens")
    return _RingAttention.apply(q, k, v, cp)


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
