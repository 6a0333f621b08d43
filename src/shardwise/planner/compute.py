"""Compute time: FLOPs by `shardwise.telemetry.flops`' declared formula over the achievable FLOP/s.

A rank's FLOPs per micro-batch are its blocks' share of 6N + 12LHQT/2 (per kind of block, from
`ModelDims.layer_flops`: each block is a `FlopCounts` with n_layers = 1) plus the output
projection on the last stage, plus the forward of its recomputed blocks
(`FlopCounts.recompute_per_token`: torch's checkpoint stops before a block's last projection),
for the micro-batch's tokens, divided by tp (every matmul is split) and cp (each rank holds 1/cp
of the sequence; causal attention load-balanced across the cp ranks, as in Llama 3's CP). Expert
parallel moves tokens, not FLOPs: on average each rank computes its share.

time = FLOPs / (peak FLOP/s of the precision x `CostParams.efficiency`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.planner.bubble import RankLoad
from shardwise.planner.models import ModelDims
from shardwise.planner.op_checkpoint import recompute_flops_per_token, supports_op_checkpoint


@dataclass(frozen=True)
class KindFlops:
    """Per token, for one block of a kind: model FLOPs (forward + backward), the recompute's
    forward, and the split into forward / input-gradient / weight-gradient work (ZBV's bubble)."""

    model: float
    recompute: float
    forward: float
    input_grad: float
    weight_grad: float
    op_recompute: float = 0.0  # the recompute under per-op checkpointing (`op_checkpoint`)

    def recomputed(self, op: bool) -> float:
        return self.op_recompute if op else self.recompute


@lru_cache(maxsize=1024)
def kind_flops(model: ModelDims, kind: str, seq_len: int) -> KindFlops:
    fc = model.layer_flops(kind, seq_len)
    attn_fwd = fc.attention(1, 1, causal_halved=True)
    n = fc.matmul_params
    op = recompute_flops_per_token(model) if supports_op_checkpoint(model) else 0.0
    return KindFlops(model=fc.per_token(), recompute=fc.recompute_per_token(1),
                     forward=2.0 * n + attn_fwd, input_grad=2.0 * n + 2 * attn_fwd,
                     weight_grad=2.0 * n, op_recompute=op)


@lru_cache(maxsize=65536)
def rank_flops(model: ModelDims, load: RankLoad, seq_len: int, tokens: int, tp: int,
               cp: int, op: bool = False) -> tuple[float, float]:
    """(hardware FLOPs, model FLOPs) one rank runs for one micro-batch of `tokens` tokens
    (`op`: its checkpointed blocks per op)."""
    if model.opaque:
        f = 6.0 * model.params * tokens
        return f, f
    dense, moe = kind_flops(model, "dense", seq_len), kind_flops(model, "moe", seq_len)
    per_token = load.dense * dense.model + load.moe * moe.model
    if load.last:
        per_token += head_flops_per_token(model, seq_len)
    recompute = load.ck_dense * dense.recomputed(op) + load.ck_moe * moe.recomputed(op)
    split = tp * cp
    return (per_token + recompute) * tokens / split, per_token * tokens / split


@lru_cache(maxsize=1024)
def model_flops_per_token(model: ModelDims, seq_len: int) -> float:
    """The MFU numerator: `telemetry.flops`' per_token (causal attention counted once)."""
    return model.flop_counts(seq_len).per_token()


@lru_cache(maxsize=1024)
def head_flops_per_token(model: ModelDims, seq_len: int) -> float:
    return model.head_flops(seq_len).per_token()
