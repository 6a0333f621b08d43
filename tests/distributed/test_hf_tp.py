"""Hugging Face models under tensor parallel (#24): an input embedding with a padding row (most HF
configs set `pad_token_id`; Gemma's is tied to the output projection) trains at tp2 as in the
single process — losses, parameters, both AdamW moments, the padding row's zero gradient — and
what the vocabulary-parallel lookup or a tie cannot take is refused by the launcher, before any
worker starts (exit 2, one paragraph).

Tiny configs built here, offline (HF_HUB_OFFLINE=1); gloo, world <= 4.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.data import BatchLayout, TrainBatches, prepare_data  # noqa: E402
from shardwise.errors import SpecError  # noqa: E402
from shardwise.models.hf.plan import hf_plan  # noqa: E402
from shardwise.models.registry import build_model  # noqa: E402
from shardwise.parallel.checks import check_layout  # noqa: E402
from shardwise.parallel.dims import ParallelDims  # noqa: E402
from shardwise.spec import spec_from_dict, spec_to_toml  # noqa: E402
from shardwise.spec.model import ModelSection  # noqa: E402
from tests.support.cli import shardwise  # noqa: E402
from tests.support.compare import assert_model_close  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402
from tests.support.specs import grid, tiny_spec_dict  # noqa: E402
from tests.support.workers import train, train_single  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# layout -> (world, parallel section); tp = 2 in each
LAYOUTS = {"tp2": (2, {"tp": 2, "dp_shard": 1, "sequence_parallel": True}),
           "tp2-nosp": (2, {"tp": 2, "dp_shard": 1, "sequence_parallel": False}),
           "zero3-2+tp2": (4, {"tp": 2, "dp_shard": 2})}


def _spec(corpus, run_dir, config: dict, world: int = 1, **parallel):
    # AdamW eps = 1e-5 as in test_hf.py's verify runs: with 1e-8 an element whose gradient is
    # almost zero moves by about lr * sign(gradient), which flips with the summation order
    spec = tiny_spec_dict(corpus, run_dir, run={"steps": 3}, optimizer={"eps": 1e-5},
                          parallel={"nproc": world, **parallel})
    spec["model"] = {"family": "hf", "hf_config": config}
    return spec_from_dict(spec).validate()


def _frequent_upper_token(corpus, tmp_path) -> int:
    """A token the first step reads often among the rows tp rank 1 holds (the upper half of the
    vocabulary at tp2): as the padding row it is then looked up many times, and from a shard
    whose local index differs from the global one."""
    spec = _spec(corpus, tmp_path / "unused", LLAMA)
    data = prepare_data(spec.data)
    layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, 1)
    batches, _ = TrainBatches(data.split("train", spec.data.seq_len), spec.run.seed, layout, 0,
                              torch.device("cpu")).next_step()
    ids = torch.cat([inputs.flatten() for inputs, _ in batches])
    half = data.vocab_size // 2
    counts = torch.bincount(ids, minlength=data.vocab_size)[half:]
    assert counts.max() >= 3, counts.max()  # it is looked up, several times per step
    return half + int(counts.argmax())


def _moments(optim: dict, name: str) -> dict:
    return {k: v for k, v in optim.items() if k.endswith("." + name)}


@pytest.mark.parametrize(("layout", "tied"), [
    ("tp2", True),
    pytest.param("tp2-nosp", False, marks=pytest.mark.grid),
    pytest.param("zero3-2+tp2", True, marks=pytest.mark.grid)])
def test_padding_row_trains_as_in_the_single_process(layout, tied, small_corpus, tmp_path):
    """The embedding's padding row gets no gradient from the lookup (the rank that holds it
    zeroes it; the other never touches it), so a tied tensor's row moves by the output
    projection's gradient alone, as in one process. Before: refused in every worker."""
    pad = _frequent_upper_token(small_corpus, tmp_path)
    config = {**LLAMA, "pad_token_id": pad, "tie_word_embeddings": tied}
    world, parallel = LAYOUTS[layout]
    want = train_single(_spec(small_corpus, tmp_path / "dp1", config))
    got = run_ranks(train, world, _spec(small_corpus, tmp_path / layout, config, world,
                                        **parallel), timeout=120)[0]

    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=1e-5, atol=0)
    assert_model_close(got["params"], want["params"], rtol=1e-5)
    for moment in ("exp_avg", "exp_avg_sq"):
        assert_model_close(_moments(got["optim"], moment), _moments(want["optim"], moment),
                           rtol=1e-5, atol_max=1e-6)
    first = build_model(ModelSection.of(family="hf", hf_config=config), 512, 32, seed=7)
    assert not first.model.embed_tokens.weight[pad].any()  # HF's init zeroes the padding row
    row = {name: got["optim"][f"state.{EMBED}.{name}"][pad] for name in ("exp_avg", "exp_avg_sq")}
    if tied:  # the output projection's gradient, the same as in one process
        assert row["exp_avg"].abs().min() > 0
        for name, value in row.items():
            torch.testing.assert_close(value, want["optim"][f"state.{EMBED}.{name}"][pad],
                                       rtol=1e-5, atol=1e-9)
    else:  # no gradient at all: the row and both moments stay exactly zero
        assert not got["params"][EMBED][pad].any() and not want["params"][EMBED][pad].any()
        assert not row["exp_avg"].any() and not row["exp_avg_sq"].any()
        assert got["optim"][f"state.{EMBED}.exp_avg"].count_nonzero(dim=1).count_nonzero() > 50


# --- refused before any worker -----------------------------------------------------------------
def _one_paragraph(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message and len(message) < 900, message


# option -> (a value the vocabulary split cannot honour, the default)
EMBEDDING_OPTIONS = {"max_norm": (1.0, None), "scale_grad_by_freq": (True, False),
                     "sparse": (True, False)}


@pytest.mark.parametrize("option", grid(list(EMBEDDING_OPTIONS), default=("max_norm",)))
def test_embedding_options_the_split_cannot_honour_are_refused_up_front(option, small_corpus,
                                                                         tmp_path):
    """No HF config sets these, so the model is changed after its build: the plan hf_plan
    gives then carries the refusal, and the launcher's layout check (parallel/checks.py, exit 2)
    says it in one paragraph. Before: max_norm was a PlanError with a traceback in every
    worker, scale_grad_by_freq and sparse were not refused at all."""
    spec = _spec(small_corpus, tmp_path / "run", {**LLAMA, "pad_token_id": 0}, 2,
                 tp=2, dp_shard=1)
    model = build_model(spec.model, 512, 32, seed=0, device="meta")
    embedding = model.model.embed_tokens
    refused, default = EMBEDDING_OPTIONS[option]
    setattr(embedding, option, refused)
    plan = hf_plan(model, 32)
    assert not plan.tp and plan.tp_unavailable
    with pytest.raises(SpecError) as caught:
        check_layout(spec, ParallelDims.from_spec(spec.parallel, 2), plan, accumulation=4)
    message = str(caught.value)
    _one_paragraph(message)
    assert message.startswith("tensor parallel tp = 2: model.embed_tokens is an embedding with "
                              f"{option} = ") and "Use tp = 1" in message
    setattr(embedding, option, default)  # padding_idx alone: split as any embedding
    plan = hf_plan(model, 32)
    assert plan.tp["model.embed_tokens"] == "embedding" and not plan.tp_unavailable


@pytest.mark.grid  # 7 s, a CLI run
def test_a_tie_split_two_ways_is_refused_before_any_worker(small_corpus, tmp_path):
    """A plan that would split one tied tensor by row for the embedding and by column (or not
    at all) for the output projection: exit 2, one paragraph, no worker started (the run
    directory is never made). Before: a PlanError in every worker (or, with the head left out
    of the plan, a tie silently broken)."""
    spec = _spec(small_corpus, tmp_path / "run", {**LLAMA, "tie_word_embeddings": True}, 2,
                 tp=2, dp_shard=1)
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec))
    proc = shardwise("train", str(config), "--set", 'model.hf_tp_plan={"model.embed_tokens" = '
                     '"embedding_rowwise", "lm_head" = "rowwise"}', cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists() and "[rank" not in proc.stderr
    message = " ".join(proc.stderr.split())
    _one_paragraph(message)
    assert ("would split the tied tensor model.embed_tokens.weight = lm_head.weight in different "
            "ways: model.embed_tokens.weight by row (style 'embedding'); lm_head.weight by column "
            "(style 'rowwise')") in message
