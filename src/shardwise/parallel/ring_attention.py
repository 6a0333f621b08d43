"""Ring attention for context parallel (`parallel.context`): every rank holds a zigzag share of
each sequence (chunks r and 2N-1-r of 2N) and attends over the whole sequence.

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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from shardwise.parallel.collectives import all_gather_flat, reduce_scatter_flat

__all__ = ["CPGroup", "ring_attention"]
_KV_TAG, _DKV_TAG = 1, 2


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
