"""What a published source's throughput figure means: a reference set's `measured.kind`
(benchmarks/published_runs.toml, [conventions].measured), turned into the job's tokens/s so that
sources that count FLOPs differently (Megatron's recompute and full attention square, PaLM's) are
compared on one footing."""

from __future__ import annotations

from collections.abc import Callable

from shardwise.planner.layout import Batch
from shardwise.planner.models import ModelDims


def megatron_sc21_flops_per_token(m: ModelDims, s: int) -> float:
    """Narayanan et al. (SC21) Eq. 3 per token: 96·l·h²·(1 + s/6h + V/16lh) (full recompute,
    full-square attention)."""
    h, layers, v = m.hidden, m.layers, m.vocab
    return 96.0 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def megatron_core_flops_per_token(m: ModelDims, s: int) -> float:
    """Megatron-Core's num_floating_point_operations (r0.8.0, megatron/training/training.py) per
    token: 12·l·h²·((1 + g/a + s/h)·(a·d/h) + (f/h)·(3/2 if SwiGLU) + V/2lh)."""
    h, layers = m.hidden, m.layers
    a, g, d = m.heads, m.kv, m.hd
    gate = 1.5 if m.gated else 1.0
    attn = (1 + g / a + s / h) * (a * d / h)
    return 12.0 * layers * h * h * (attn + (m.ffn / h) * gate + m.vocab / (2 * layers * h))


def palm_flops_per_token(m: ModelDims, s: int) -> float:
    """Chowdhery et al. (PaLM), appendix B: 6N + 12·L·H·Q·T (full-square attention)."""
    return m.flop_counts(s).per_token(causal_halved=False)


#: a TFLOP/s-per-GPU figure -> the source's FLOPs per token
FLOP_FORMULAS = {
    "tflops_megatron_sc21": megatron_sc21_flops_per_token,
    "tflops_megatron_core": megatron_core_flops_per_token,
    "tflops_palm": palm_flops_per_token,
}
#: a rate of tokens, sequences or steps -> the job's tokens/s (value, batch, GPUs): tokens/s of
#: the whole job or per GPU (torchtitan's TPS/GPU), sequences/s, seconds per optimizer step
RATE_KINDS: dict[str, Callable[[float, Batch, int], float]] = {
    "tokens_per_s": lambda value, batch, gpus: value,
    "tokens_per_s_per_gpu": lambda value, batch, gpus: value * gpus,
    "samples_per_s": lambda value, batch, gpus: value * batch.seq_len,
    "step_s": lambda value, batch, gpus: batch.tokens / value,
}
#: a model FLOPs utilisation (a fraction of the device's dense peak in the run's precision) ->
#: the source's FLOPs per token: PaLM's MFU, as the Llama 3 paper and most since print it
MFU_FORMULAS = {"mfu_palm": palm_flops_per_token}
MEASURED_KINDS = (*FLOP_FORMULAS, *MFU_FORMULAS, *RATE_KINDS)


def tokens_per_s(kind: str, value: float, model: ModelDims, batch: Batch, gpus: int,
                 peak_flops: float = 0.0) -> float:
    """The job's tokens/s that a source's throughput figure implies (`MEASURED_KINDS`); an MFU
    is taken against `peak_flops`, the device's dense peak per GPU."""
    if kind in RATE_KINDS:
        return RATE_KINDS[kind](value, batch, gpus)
    if kind in MFU_FORMULAS:
        return value * peak_flops * gpus / MFU_FORMULAS[kind](model, batch.seq_len)
    return value * 1e12 * gpus / FLOP_FORMULAS[kind](model, batch.seq_len)
