"""`CostParams`: every tunable of the cost model, with its default and where that comes from.

Two kinds of field. **Efficiencies** are what no datasheet gives and the harness fits on
published runs (`planner/validate.py`, `python benchmarks/bench_plan.py --published`): the
fraction of the dense peak a large GEMM and the fused attention kernels reach per hardware
generation, the GEMM's fixed cost in units of its reduction length, and the share of
overlappable communication that hides. **Mechanics** say how the framework trains (which
communication it overlaps, what precision it keeps parameters and gradients in, what its
recompute reruns): shardwise's own by default; a published run's row states its framework's
(`benchmarks/published_runs.toml`, [[sources]].stack), and those are facts, not fits.
A calibration on your own runs (`shardwise plan --calibrate`) writes a new `CostParams`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardwise.planner.fitted import FITTED
from shardwise.spec.cluster import GIB


@dataclass(frozen=True)
class CostParams:
    """Every tunable of the cost model, with its default and where that comes from."""

    def __hash__(self) -> int:  # hashed by every cached cost term: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(self.__dict__[name] for name in _FIELD_NAMES))
            self.__dict__["_hash"] = cached
        return cached

    # Achievable fraction of the dense peak for every kernel where the device's generation is
    # not known (a CPU, a cluster file without [device] generation): FLOPs / (peak x this).
    # On a GPU of a known generation the kernel model (`planner/kernels.py`) uses the fields
    # below instead. 0.60: Llama 3 405B's published layout as Meta ran it lands in its 38-43 %
    # band (the figure this model was calibrated on before the kernel model).
    efficiency: float = 0.60
    # The fitted fields below take their defaults from `planner/fitted.py`, which
    # `python benchmarks/bench_plan.py --published --write-fit` writes from the fit on every
    # published run (benchmarks/RESULTS.md gives the fit's error, in-sample and held out).
    # Fraction of the dense peak a large bf16/fp16 GEMM sustains, per generation: what the runs
    # achieve end to end, so clock throttling under load and kernel gaps are in it.
    gemm_efficiency_ampere: float = FITTED["gemm_efficiency_ampere"]
    gemm_efficiency_hopper: float = FITTED["gemm_efficiency_hopper"]
    # Fraction of the dense peak the fused attention kernels reach, forward and backward
    # (bounded by the published kernel figures: FlashAttention-2 on an A100 50-73 % of peak,
    # FlashAttention-2 to -3 and cuDNN on an H100 35-75 %).
    attention_efficiency_ampere: float = FITTED["attention_efficiency_ampere"]
    attention_efficiency_hopper: float = FITTED["attention_efficiency_hopper"]
    # A GEMM's fixed per-tile work (prologue, epilogue) in units of its reduction length k, per
    # generation: its efficiency scales by k / (k + this).
    gemm_k_half_ampere: float = FITTED["gemm_k_half_ampere"]
    gemm_k_half_hopper: float = FITTED["gemm_k_half_hopper"]
    # Fraction of overlappable communication (`overlapped`) that hides behind compute when there
    # is compute to hide behind (FSDP's gathers: `fsdp_overlap`).
    overlap: float = FITTED["overlap"]
    # The same for FSDP's per-micro-batch parameter gathers and gradient reduce-scatters (ZeRO-3;
    # ZeRO-2 without pipeline parallel; under it ZeRO-2 gathers once per step, under `overlap`):
    # a unit cannot start before its parameters arrive (at most two gathers in flight), and its
    # collectives take SMs and HBM bandwidth from the GEMMs they run beside, so they hide less
    # than a bucketed gradient reduction running behind the backward does.
    fsdp_overlap: float = FITTED["fsdp_overlap"]
    # On a GPU of a known generation (the kernel model), per optimizer step: host work the
    # devices wait on outside the micro-batches' kernels (reading the loss, logging and metrics,
    # the gradient norm for clipping, launching the optimizer's kernels, handing over the next
    # batch). Seconds, fitted on published runs; a CPU run's host work is in the measured
    # framework-overhead fields below instead.
    step_host_s: float = FITTED["step_host_s"]
    # Which communication the framework overlaps with compute: "tp" (tensor-parallel
    # collectives split into tp chunks pipelined with the GEMM chunks, as Transformer Engine's
    # TP comm overlap does: one chunk stays exposed, `comm.pipelined`), "cp" (the ring's K/V
    # passes), "pp" (send and receive), "dp" (FSDP's parameter gathers, ZeRO-2's once-per-step
    # gather under pipeline parallel with the first micro-batch's forward, and the gradient
    # reduction with the last backward), "dp_under_pp" (that reduction also under pipeline
    # parallel; torch's pipelining, which shardwise uses, runs it after the last backward),
    # "param_gather" (ZeRO-1's all-gather of the updated parameters, with the next step's
    # forward).
    overlapped: tuple[str, ...] = ("cp", "pp", "dp")
    # Parameters held in the compute dtype with fp32 masters in the optimizer (Megatron); False:
    # fp32 parameters that are their own masters (shardwise, docs/precision.md).
    low_precision_params: bool = False
    # Every copy of a parameter's state in the compute dtype: the parameters themselves, with no
    # fp32 master anywhere, and both AdamW moments (NeMo AutoModel's MoE recipes cast the whole
    # model to bf16, and torch's Adam keeps its moments in the parameters' dtype); state its
    # gradients' bytes in `grad_bytes`. False: fp32 masters and moments.
    state_in_compute_dtype: bool = False
    # Bytes per gradient element kept and reduced (fp32: 4; Megatron's fp16 runs: 2).
    grad_bytes: int = 4
    # Recompute reruns a block's whole forward (Megatron); False: torch's checkpoint stops
    # before the block's last projection (`telemetry.flops`).
    recompute_whole_block: bool = False
    # FSDP reduce-scatters every micro-batch's gradients and accumulates the shards (PyTorch
    # FSDP's default); False: shardwise skips the reduction until the last micro-batch and
    # accumulates the unsharded gradients (`parallel/execution.py`).
    reduce_every_micro_batch: bool = False
    # Sequences per data-parallel rank that one call of the pipeline schedule runs; gradient
    # accumulation repeats the call, and each call fills and drains the pipeline (NeMo
    # AutoModel's "LBS" around torch's pipelining). 0: the step's micro-batches in one call
    # (shardwise, Megatron).
    pipeline_local_batch: int = 0
    # Fraction of line rate NCCL's large-message bus bandwidth reaches (nccl-tests busbw is
    # typically 80-90 % of the link's line rate on NVLink and InfiniBand).
    bandwidth_efficiency: float = 0.85
    # Base latency of one collective: NCCL tuning.cc baseLat for ring/Simple (8.4 µs); the
    # per-step latencies come from the ClusterSpec's links.
    collective_latency_s: float = 8.4e-6
    # Tensor-parallel and expert-parallel collectives sit between dependent matmuls: shardwise does
    # not overlap them (async TP / DualPipe would); 0 = fully exposed.
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    # How expert parallel moves tokens and which experts a token picks (`planner/dispatch.py`):
    # "all_to_all" sends one copy per routed expert (Megatron's alltoall dispatcher, shardwise's);
    # "deduplicated" one per destination rank, and one per destination node across nodes (DeepEP).
    ep_dispatch: str = "all_to_all"
    # "uniform": independent top-k choices over the experts; "consecutive": adjacent expert ids
    # (a forced-balanced benchmark gate's routing).
    ep_routing: str = "uniform"
    # Megatron's scatter/gather pipeline optimisation (Narayanan et al. SC21 §4.1; on by default
    # there, and only without sequence parallelism): each tensor-parallel rank sends 1/tp of the
    # activation over its own NIC and the receiving ranks all-gather it over NVLink. False:
    # every tensor-parallel rank sends the whole (replicated) activation, as shardwise does.
    pp_scatter_gather: bool = False
    # How the pipeline cuts the blocks into stages (`planner/bubble.py`, `PP_SPLITS`): "flops",
    # as shardwise cuts them (by FLOPs, the output head counted on the last stage); "even",
    # Megatron's default (the blocks by count, the embedding and the head on top of the first and
    # last stages' share); "ends_as_layers", the embedding and the head (with the loss) counted
    # as one block each and cut by count (Megatron's --account-for-embedding-in-pipeline-split
    # and --account-for-loss-in-pipeline-split; Llama 3 §3.3.2).
    pp_split: str = "flops"
    # Memory: the caching allocator's reserved-but-unused share of what is allocated.
    fragmentation: float = 0.10
    # CUDA context, cuBLAS/cuDNN workspaces and NCCL's communicator buffers per rank.
    runtime_overhead_bytes: float = 1.0 * GIB
    # Bytes per residual-stream element: shardwise keeps the residual stream and norms in fp32
    # (docs/precision.md); Megatron and Korthikanti et al. keep them in bf16 (2).
    residual_bytes: int = 4
    fused_attention: bool = True  # scaled_dot_product_attention: no s x s score matrix kept
    dropout: bool = False  # the built-in GPT and Llama-style models train without dropout
    # Bytes per logit at the loss: bf16 logits, their fp32 copy, the fp32 log-softmax saved for
    # backward (shardwise computes the loss on fp32 logits).
    logits_bytes: float = 10.0
    # The blocks run as eager PyTorch modules written like the built-in GPT (`models/gpt.py`;
    # Meta's reference Llama, Hugging Face's and torchtitan's without torch.compile): the extra
    # tensors they save (RMSNorm's normalised input, GQA's repeated K/V, the output projection's
    # copy of the attention output; `planner/memory.py`, measured with saved-tensor hooks) and
    # their elementwise work as one kernel an op (`planner/elementwise.py`, measured with a
    # dispatch mode). False: fused kernels (Megatron-Core, Transformer Engine, torch.compile)
    # and the textbook activations (Korthikanti et al.).
    eager_modules: bool = True
    # Elementwise work redone in backward instead of saved (`planner/memory.py`), Megatron-Core's
    # module-level recompute (`recompute_modules`): "layernorm", the norms' outputs recomputed
    # from their inputs; "moe_act", the routed experts' activation recomputed from the first
    # GEMM's output. `recompute_act`: the dense MLP's (and shared experts') activation likewise,
    # as a hand-written block backward that saves only what is expensive to compute (LLaMA,
    # Touvron et al. 2023, §2.4: "the outputs of linear layers"). shardwise runs none of them.
    recompute_norms: bool = False
    recompute_moe_act: bool = False
    recompute_act: bool = False
    # Where the router's weights scale the routed experts' outputs: at the combine, which saves
    # those outputs for the weights' gradient (shardwise's MoE, torchtitan's); False: inside the
    # experts' activation (Megatron-Core's weighted activation), the combine saving nothing.
    moe_weights_at_combine: bool = True
    # A CPU worker (`cpu-local`): what the process holds before its model exists (Python, torch
    # and its distributed packages, gloo, the data): 320-321 MiB measured per worker on this
    # machine (the memory event's rss_before_model_bytes_per_rank; bench_init: 322 MB); the host
    # allocator's resident share above what torch has allocated, and under ZeRO-1 / FSDP the
    # fp32 copies of the rank's whole model glibc keeps of their per-step transients
    # (`planner/memory.py`; both measured on this machine's runs, tests/distributed/test_plan_measured.py).
    cpu_runtime_overhead_bytes: float = 0.31 * GIB
    cpu_fragmentation: float = 0.05
    cpu_zero1_retained_copies: float = 1.0
    cpu_fsdp_retained_copies: float = 3.6
    # Framework overhead (module docstring; defaults derived from the compute_s_per_rank of the
    # 01:35 UTC bench_plan runs, 2026-12-02, against ddp2's 177.5 ms at the same FLOPs per rank).
    # FSDP2, per unit (`fsdp_units`) per micro-batch: its pre/post forward and backward hooks.
    # With the next field, from zero2-2 (+94 ms: 5 units x 4 micro-batches, 4 gathers) and
    # zero3-2 (+124 ms: 8 gathers): 20 h + 20 g = 94 ms and 20 h + 40 g = 124 ms.
    fsdp_unit_overhead_s: float = 3.2e-3
    # FSDP2, per unit per all-gather: the copy into the flat buffer and out to the parameters.
    fsdp_gather_overhead_s: float = 1.5e-3
    # Tensor parallel, per DTensor-sharded linear (q, k, v, o and the FFN's matrices of every
    # block, recomputed ones again, the embedding and the output layer) per micro-batch, forward
    # and backward: tp2's +155 ms over 8 micro-batches of 30 linears.
    tp_op_overhead_s: float = 0.65e-3
    # ZeRO-1, per parameter tensor per step: a DTensor gradient shard, the AdamW update on
    # DTensors and `full_tensor()` (`parallel/data_parallel.Zero1Optimizer`): zero1-2's +77 ms
    # over 39 tensors.
    zero1_tensor_overhead_s: float = 2.0e-3
    # Context parallel, per block (recomputed ones again) per cp chunk per micro-batch: ring
    # attention's unfused per-chunk attention and merge (benchmarks/RESULTS.md, bench_cp: ~4x
    # the fused SDPA step). From a 5-step cp2 run of the bench_plan model before the 07:17 UTC
    # runs (compute 396-416 ms per rank against ddp2's 177.5 over 8 micro-batches x 4 blocks
    # x 2 chunks): 3.6 ms.
    cp_chunk_overhead_s: float = 3.6e-3


#: the framework-overhead fields of `CostParams` (`overhead_counts`), which `--calibrate` fits
OVERHEAD_FIELDS = ("fsdp_unit_overhead_s", "fsdp_gather_overhead_s", "tp_op_overhead_s",
                   "zero1_tensor_overhead_s", "cp_chunk_overhead_s")

DEFAULT_PARAMS = CostParams()

_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(CostParams))

#: which `CostParams.overlapped` entries the cost model knows
#: how a pipeline cuts the blocks into stages (`CostParams.pp_split`)
PP_SPLITS = ("flops", "even", "ends_as_layers")

OVERLAPPABLE = ("tp", "cp", "pp", "dp", "dp_under_pp", "param_gather")

#: the fitted efficiencies of `CostParams` (`planner/validate.py` fits them)
FITTED_FIELDS = ("gemm_efficiency_ampere", "gemm_efficiency_hopper",
                 "attention_efficiency_ampere", "attention_efficiency_hopper",
                 "gemm_k_half_ampere", "gemm_k_half_hopper", "overlap", "fsdp_overlap",
                 "step_host_s")


@dataclass(frozen=True)
class BlockSaves:
    """Which of a block's textbook tensors the implementation keeps for backward: the norms'
    outputs (False: recomputed, Megatron's "layernorm" module recompute), the routed experts'
    activation output (False: Megatron's "moe_act"), the dense MLP's and shared experts'
    activation output (False: recomputed from the first GEMM's outputs) and the experts' outputs
    at the combine (False: the router's weights applied inside the activation, so the combine
    needs none)."""

    norms: bool = True
    moe_act: bool = True
    combine: bool = True
    act: bool = True

    @classmethod
    def of(cls, params: CostParams) -> BlockSaves:
        return cls(norms=not params.recompute_norms, moe_act=not params.recompute_moe_act,
                   combine=params.moe_weights_at_combine, act=not params.recompute_act)


#: an implementation that keeps every textbook tensor (shardwise's own)
SAVES_ALL = BlockSaves()
