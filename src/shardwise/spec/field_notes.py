"""Descriptions of the RunSpec's fields that the source leaves without a comment: data for the
reference generator (`shardwise.spec.reference`, which writes docs/runspec.md), kept apart so that
the generator is code only.

The source stays the first place to document a field (a comment beside it); a note here is
appended to that comment where there is one. `tests/unit/test_docs_reference.py` fails when a field
has neither, and when a note names a field that no longer exists.
"""

from __future__ import annotations

#: Descriptions of the fields the source leaves without a comment, keyed `section.key` (the
#: cluster file's sections and the fault grammar's keys included). A note is appended to the
#: source's own comment where there is one, so it only adds what the comment does not say.
FIELD_NOTES: dict[str, str] = {
    # [run]
    "run.name": "The run's name: the run directory is `runs/<name>-<timestamp>` unless `dir` is "
                "set. One plain path component: letters, digits, `.`, `_`, `-`, not starting with "
                "`.` or `-`, at most 100 characters.",
    "run.dir": "A relative path is relative to where shardwise runs.",
    "run.seed": "Seeds the model's initialisation, the data order (a keyed permutation of seed "
                "and epoch) and sampling; the same seed gives the same samples at every layout.",
    "run.precision": "One mixed-precision policy on every layout: fp32 master weights, gradients "
                     "and optimizer state; `bf16`/`fp16` matmuls and attention under autocast; "
                     "`fp16` adds dynamic loss scaling (`[loss_scale]`). See [precision.md](precision.md).",
    "run.determinism": "See [reproducibility.md](reproducibility.md).",
    # [model]
    "model.family": "`gpt` (the built-in), `moe-gpt` (the built-in mixture of experts, shaped by "
                    "the `moe_*` keys), `hf` (a Hugging Face model, `hf_config` or `hf_path`), "
                    "`\"py:FILE.py:FUNCTION\"` (your own `nn.Module`, built by "
                    "`FUNCTION(args, vocab_size)`), or a name an installed package registers "
                    "under the `shardwise.models` entry points. See [models.md](models.md).",
    "model.init": "`meta`: built on the meta device, each rank materialises only the tensors it "
                  "keeps, with the eager build's values bit for bit; `eager`: every rank builds "
                  "the whole model first.",
    "model.hf_path": "Family `hf`: a local `save_pretrained` directory (`config.json` and "
                     "`model.safetensors`) to fine-tune; never a hub id (nothing is downloaded). "
                     "Exactly one of `hf_config` and `hf_path`. See [huggingface.md](huggingface.md).",
    "model.n_layers": "GPT families: transformer blocks.",
    "model.d_model": "GPT families: model width; a multiple of `n_heads` with an even head width "
                     "(rotary embeddings).",
    "model.n_heads": "GPT families: attention heads.",
    "model.n_kv_heads": "GPT families: key/value heads (grouped-query attention); divides "
                        "`n_heads`.",
    "model.tie_embeddings": "GPT families: the output projection is the input embedding (one "
                            "tensor on every layout).",
    "model.rope_theta": "GPT families: base of the rotary position embedding.",
    "model.norm_eps": "GPT families: epsilon of RMSNorm.",
    "model.init_std": "GPT families: standard deviation of the weight initialisation.",
    "model.moe_experts": "E, experts per MoE layer.",
    "model.moe_top_k": "k, experts each token is routed to (at most `moe_experts`).",
    # [data]
    "data.seq_len": "Text: tokens per training sequence (packed from the token stream).",
    "data.val_fraction": "Text: the last fraction of the token stream, held out for evaluation.",
    "data.content_hash": "Filled in at run time (SHA-256 of the data) and checked on resume; "
                         "clear it to accept changed data.",
    "data.tokenizer_hash": "Filled in at run time (SHA-256 of the tokenizer) and checked on "
                           "resume.",
    # [batch]
    "batch.global_batch": "Sequences (samples) per optimizer step, over all ranks.",
    "batch.micro_batch": "Sequences per forward pass per rank; gradient accumulation = "
                         "global_batch / (micro_batch × data-parallel degree), checked.",
    # [optimizer]
    "optimizer.name": "The optimizer: AdamW, one per model part.",
    "optimizer.lr": "Peak learning rate, reached after `warmup_steps`.",
    "optimizer.min_lr": "Learning rate at the end of the cosine schedule (at most `lr`).",
    "optimizer.warmup_steps": "Steps of linear warmup.",
    "optimizer.schedule": "`cosine`: from `lr` down to `min_lr` over `run.steps`; `constant`.",
    "optimizer.beta1": "AdamW's first-moment decay, in [0, 1).",
    "optimizer.beta2": "AdamW's second-moment decay, in [0, 1).",
    "optimizer.eps": "AdamW's epsilon.",
    "optimizer.weight_decay": "Decoupled weight decay, on matrices only.",
    # [parallel]
    "parallel.dp_replicate": "Data-parallel replicas (DDP, or HSDP's replicate dimension).",
    "parallel.dp_shard": "Data-parallel ranks that shard state (ZeRO/FSDP); -1: every rank the "
                         "other degrees leave.",
    "parallel.tp": "Tensor-parallel degree (Megatron column/row split).",
    "parallel.pp": "Pipeline-parallel degree.",
    "parallel.cp": "Context-parallel degree: every sequence split over `cp` ranks, ring "
                   "attention. See [layouts.md](layouts.md).",
    "parallel.ep": "Expert-parallel degree (mixture-of-experts models): experts spread over "
                   "`ep` ranks borrowed from data and context parallel; divides dp_replicate × "
                   "dp_shard × cp.",
    "parallel.zero": "What is sharded along dp_shard: 0 nothing (DDP), 1 optimizer state, 2 also "
                     "gradients, 3 also parameters; -1: 3 when dp_shard > 1, else 0.",
    "parallel.pp_schedule": "Pipeline schedule; `interleaved-1f1b` needs `pp_virtual_stages` ≥ 2, "
                            "`zero-bubble` (ZB-V) `pp_virtual_stages` = 2.",
    # [memory]
    "memory.ac_every": "With `activation_checkpoint = \"selective\"`: checkpoint every N-th block.",
    # [loss_scale]
    "loss_scale.init_scale": "fp16: the loss scale at the first step.",
    "loss_scale.growth_factor": "fp16: the scale is multiplied by this after `growth_interval` "
                                "good steps (above 1).",
    "loss_scale.backoff_factor": "fp16: the scale is multiplied by this when a step overflows "
                                 "(in (0, 1)).",
    "loss_scale.growth_interval": "fp16: good steps in a row before the scale grows.",
    # [failure]
    "failure.max_restarts": "from the newest valid checkpoint (or from step 0 when the failure "
                            "came before the first one).",
    "failure.straggler_windows": "Log windows in a row a rank must stay above "
                                 "`straggler_factor` to be named a straggler.",
    # [eval]
    "eval.batches": "Global batches of the held-out split per evaluation (the same sequences "
                    "on every layout).",
    # [checkpoint]
    "checkpoint.enabled": "false: no checkpoints at all (nothing to resume).",
    # [log]
    "log.every": "Steps between `step` events (metrics.jsonl, TensorBoard, the progress line).",
    "log.tensorboard": "TensorBoard event files in RUN_DIR/tb/.",
    # [telemetry]
    "telemetry.prometheus_host": "The address rank 0's Prometheus endpoint binds to.",
    # [sample]
    "sample.prompt": "Text the sample starts from.",
    "sample.temperature": "Sampling temperature.",
    "sample.top_k": "Sample among the k most likely tokens (0: all).",
    # the cluster file
    "cluster.nodes": "Nodes in the cluster (`shardwise plan --nodes` overrides it).",
    "cluster.devices_per_node": "Devices (GPUs, or CPU workers) per node.",
    "cluster.device_memory_gib": "Usable memory per device, GiB (what nvidia-smi reports as "
                                 "total).",
    "cluster.nics_per_node": "Inter-node NICs per node (one per GPU on a rail-optimised fabric).",
    "cluster.name": "The cluster's name in `shardwise plan`'s output.",
    "cluster.device": "`cuda` or `cpu`: what `shardwise plan --write-spec` asks for.",
    "peak_tflops.fp32": "Dense fp32 TFLOP/s per device (CUDA cores).",
    "peak_tflops.bf16": "Dense bf16 TFLOP/s per device.",
    "peak_tflops.fp16": "Dense fp16 TFLOP/s per device.",
    "peak_tflops.tf32": "fp32 matmuls on TF32 tensor cores (0: none; `run.tf32` uses them).",
    "link.bandwidth_gbs": "GB/s (10^9 bytes/s) per direction: per device inside a node "
                          "(`[intra]`), per NIC between nodes (`[inter]`).",
    "link.latency_us": "Latency per ring step, µs.",
    # failure.faults
    "fault.kind": "What the fault does (the first part of the fault).",
    "fault.rank": "The rank it fires on; unset: every rank.",
    "fault.step": "The step it fires at (steps count from 1); unset: every step.",
    "fault.phase": "The phase of the step it fires in; unset: any.",
    "fault.ms": "`slow`: milliseconds to sleep in every step.",
    "fault.attempt": "The restart attempt it fires in (0: the first launch only, so that the "
                     "restarted run gets past it).",
}
