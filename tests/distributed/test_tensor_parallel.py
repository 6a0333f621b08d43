"""Tensor parallel as shardwise applies it (DTensor parameters, plain-tensor compute), against
the single process: the vocabulary-parallel cross entropy, the parameter placements, the number
of collectives per step (one per block input and one per row-parallel output, Megatron's
minimum), activation checkpointing and bf16 under tp.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.models import build_model
from shardwise.models.plan import IGNORE_INDEX, ModelPlan, ModelShape, plan_of
from shardwise.parallel.tensor_parallel import apply_tensor_parallel
from shardwise.parallel.vocab_parallel import vocab_parallel_loss_sum
from shardwise.spec.model import ModelSection
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single

MODEL = {"n_layers": 2, "tie_embeddings": False}


def _join(store: Any) -> tuple[int, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return rank, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _cross_entropy_rank(store: Any, dtype: torch.dtype) -> dict[str, float]:
    """Loss and gradient of the sharded cross entropy vs F.cross_entropy on the full logits."""
    rank, mesh = _join(store)
    try:
        gen = torch.Generator().manual_seed(3)
        full = (4 * torch.randn(2, 24, 64, generator=gen)).to(dtype).requires_grad_()
        targets = torch.randint(0, 64, (2, 24), generator=gen)
        targets[0, :5] = IGNORE_INDEX
        want = F.cross_entropy(full.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        want.backward()
        local = full.detach().chunk(2, dim=-1)[rank].clone().requires_grad_()
        got = vocab_parallel_loss_sum(DTensor.from_local(local, mesh, [Shard(2)]), targets)
        (2.0 * got).backward()
        return {"loss": abs(got.item() - want.item()) / want.item(),
                "grad": ((local.grad - 2.0 * full.grad.chunk(2, dim=-1)[rank]).abs().max()
                         / full.grad.abs().max()).item()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_cross_entropy_equals_the_full_one(dtype):
    """Same loss sum and gradient as F.cross_entropy on the gathered fp32 logits, on every tp
    rank, with ignored targets; bf16 logits are computed on in fp32 (the grad is bf16)."""
    for r in run_ranks(_cross_entropy_rank, 2, dtype, timeout=60):
        assert r["loss"] < 1e-6
        assert r["grad"] < (1e-5 if dtype == torch.float32 else 1e-2)


def _placements_rank(store: Any, sequence_parallel: bool) -> dict[str, Any]:
    """Placements after apply_tensor_parallel, and the parameters after a forward that raised."""
    _rank, mesh = _join(store)
    try:
        model = build_model(ModelSection.of(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
                                         ffn_hidden=64, tie_embeddings=False),
                            vocab_size=64, seq_len=8, seed=0)
        apply_tensor_parallel(model, plan_of(model), mesh, sequence_parallel=sequence_parallel,
                              loss_parallel=True)
        placements = {name: (tuple(str(p) for p in param.placements)
                             if isinstance(param, DTensor) else "plain")
                      for name, param in model.named_parameters()}
        with contextlib.suppress(RuntimeError):  # a wrong width: F.linear raises in the module
            model.layers["0"].attention.wq(torch.zeros(3, 5))
        restored = all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
        return {"placements": placements, "restored": restored}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parameters_stay_dtensors_with_the_megatron_placements(sequence_parallel):
    """Parameters keep DTensor's placements (so checkpoints reshard through DCP and FSDP2
    composes), whatever the compute does; a forward that raises leaves them in place."""
    r = run_ranks(_placements_rank, 2, sequence_parallel, timeout=60)[0]
    p = r["placements"]
    shard0, shard1 = (str(Shard(0)),), (str(Shard(1)),)
    assert p["tok_embeddings.weight"] == shard0 and p["output.weight"] == shard0
    for name in ("wq", "wk", "wv"):
        assert p[f"layers.0.attention.{name}.weight"] == shard0
    assert p["layers.0.attention.wo.weight"] == shard1
    assert p["layers.0.feed_forward.w1.weight"] == shard0
    assert p["layers.0.feed_forward.w2.weight"] == shard1
    norm = (str(Replicate()),) if sequence_parallel else "plain"
    assert p["layers.0.attention_norm.weight"] == norm and p["norm.weight"] == norm
    assert r["restored"]


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "step"]


@pytest.mark.parametrize("sequence_parallel",
                         [True, pytest.param(False, marks=pytest.mark.grid)])
def test_one_collective_per_block_input_and_row_parallel_output(sequence_parallel, small_corpus,
                                                                 tmp_path):
    """Per micro-batch, forward: one collective at the input of each attention, feed-forward
    and output block (q/k/v and w1/w3 share it) and one after each row-parallel module
    (embedding, wo, w2); backward the same. Sequence parallel: all-gathers and reduce-scatters;
    without: all-reduces. Plus one all-gather of 2 values per token for the cross entropy, one
    all-reduce per sequence-parallel norm weight for its partial gradient, one for the norm."""
    spec = tiny_spec(small_corpus, tmp_path / "run", model=MODEL, run={"steps": 2},
                     parallel={"nproc": 2, "tp": 2, "dp_shard": 1,
                               "sequence_parallel": sequence_parallel})
    run_ranks(train, 2, spec, timeout=120)
    layers, micro = spec.model.fields.n_layers, spec.batch.global_batch // spec.batch.micro_batch
    per_micro = 2 * (2 * layers + 1)  # (block inputs + row-parallel outputs) x (fwd + bwd) / 2
    tokens = spec.batch.micro_batch * spec.data.seq_len
    activation = tokens * spec.model.fields.d_model * 4
    loss_stats = 2 * 2 * tokens * 4  # all-gathered: tp x (log-sum-exp, target logit) per token
    for event in _steps(tmp_path / "run"):
        by_op = event["comm_by_op"]
        if sequence_parallel:
            gathers, scatters = by_op["all_gather:tp"], by_op["reduce_scatter:tp"]
            assert scatters["calls"] == micro * per_micro, by_op
            assert scatters["bytes"] == micro * per_micro * activation
            assert gathers["calls"] == micro * (per_micro + 1), by_op
            assert gathers["bytes"] == micro * (per_micro * activation + loss_stats)
            assert by_op["all_reduce:tp"]["calls"] == (2 * layers + 1) + 1, by_op
        else:
            assert "reduce_scatter:tp" not in by_op, by_op
            assert by_op["all_gather:tp"]["calls"] == micro, by_op
            assert by_op["all_reduce:tp"]["calls"] == micro * per_micro + 1, by_op
            assert by_op["all_reduce:tp"]["bytes"] == micro * per_micro * activation + 4


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    return train_single(tiny_spec(small_corpus, tmp_path_factory.mktemp("ref") / "run",
                                  model=MODEL))


@pytest.mark.grid  # 12 s
def test_activation_checkpointing_under_sequence_parallel(reference, small_corpus, tmp_path):
    """Recomputed blocks run the same hooks and collectives again: same losses as one process."""
    spec = tiny_spec(small_corpus, tmp_path / "run", model=MODEL,
                     memory={"activation_checkpoint": "full"},
                     parallel={"nproc": 2, "tp": 2, "dp_shard": 1, "sequence_parallel": True})
    result = run_ranks(train, 2, spec, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=0)


# bf16 under FSDP x TP at world 4 runs under `grid` (the default suite checks bf16 tp2 here and in
# test_precision_policy.py)
@pytest.mark.parametrize(("world", "dp_shard", "sequence_parallel"),
                         [(2, 1, True), pytest.param(2, 1, False, marks=pytest.mark.grid),
                          pytest.param(4, 2, False, marks=pytest.mark.grid)])
def test_bf16_tensor_parallel_tracks_bf16_single(world, dp_shard, sequence_parallel, small_corpus,
                                                 tmp_path):
    """Autocast to bf16 on local shards: the same policy as the single process (one extra bf16
    rounding of each rank's row-parallel partial output before the sum). Under FSDP (world 4)
    the gathered Linear weights and so their gradients are bf16, reduced in fp32."""
    single = train_single(tiny_spec(small_corpus, tmp_path / "single", model=MODEL,
                                    run={"precision": "bf16"}))
    spec = tiny_spec(small_corpus, tmp_path / "run", model=MODEL, run={"precision": "bf16"},
                     parallel={"nproc": world, "tp": 2, "dp_shard": dp_shard,
                               "sequence_parallel": sequence_parallel})
    result = run_ranks(train, world, spec, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]),
                               rtol=2e-2, atol=0)


class _Block(nn.Module):
    """A module shardwise knows nothing about, with biases and a LayerNorm: x + fc2(gelu(fc1(ln x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(16, 32)
        self.mlp.act = nn.GELU()
        self.mlp.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))

    def shardwise_plan(self) -> ModelPlan:
        return ModelPlan(shape=ModelShape(params=0),
                         tp={"ln": "sequence", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"})


def _block_rank(store: Any, sequence_parallel: bool) -> dict[str, float]:
    """Output and every parameter gradient of the sharded block vs the same block on one rank."""
    rank, mesh = _join(store)
    try:
        torch.manual_seed(0)
        ref = _Block()
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_()
        x = torch.randn(2, 8, 16, requires_grad=True)
        ref(x).pow(2).sum().backward()
        block = copy.deepcopy(ref)
        block.zero_grad()
        apply_tensor_parallel(block, plan_of(block), mesh, sequence_parallel=sequence_parallel,
                              loss_parallel=False)
        inp = x.detach().chunk(2, dim=1)[rank] if sequence_parallel else x.detach()
        want = ref(x).detach().chunk(2, dim=1)[rank] if sequence_parallel else ref(x).detach()
        out = block(inp)
        out.pow(2).sum().backward()
        errors = {"output": ((out - want).abs().max() / want.abs().max()).item()}
        for (name, p), q in zip(block.named_parameters(), ref.parameters(), strict=True):
            g = p.grad
            if isinstance(g, DTensor):
                if any(pl.is_partial() for pl in g.placements):
                    g = g.redistribute(placements=[Replicate()])
                g = g.full_tensor()
            errors[name] = ((g - q.grad).abs().max() / q.grad.abs().max()).item()
        return errors
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_any_declared_module_matches_one_rank_biases_included(sequence_parallel):
    """The plan of a model shardwise has never seen (LayerNorm, biased linears): output and
    gradients equal the unsharded module's — a row-parallel bias is added once, after the sum,
    and its gradient (like the norm's) is partial only under sequence parallel."""
    for r in run_ranks(_block_rank, 2, sequence_parallel, timeout=60):
        for name, err in r.items():
            assert err < 1e-5, (name, err)
