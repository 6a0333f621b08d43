"""A Hugging Face causal LM as a shardwise model: HF's own modules and parameter names, a forward
that a pipeline stage can run, and no loss inside.

`HFCausalLM` holds the HF model's base (`model.model`, `transformer`, ...) and its output
embedding under their HF names, so a parameter is called what `from_pretrained` calls it
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`): checkpoints, weight loading and
export need no renaming.

Why not HF's own forward: a pipeline stage is the model with the other stages' blocks removed
and the first / last modules set to None (`shardwise.models.plan`), and HF's forward would call
them. So each forward runs HF's base forward once as a *recording pass*, with every block
replaced by a recorder and the modules after the blocks by identities: HF's own code computes
the block inputs (embeddings and position embeddings on the first stage, the rotary tables and
the attention mask on every stage — so only floating-point hidden states cross stages) and the
recorders keep the arguments HF passes to each block. Then this stage's real blocks run with
those arguments, and on the last stage the final norm and the output projection. With no layout
(world 1) this is HF's forward, op for op: the logits are bitwise HF's.

The loss is shardwise's (next-token cross entropy, summed over real targets, divided by the
step's global count): the model is never called with `labels`, so HF's loss and its
gradient-accumulation normalisation (transformers#34191) never run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class _Call:
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder(nn.Module):
    """Stands in for block `index` during the recording pass: keeps its arguments, returns its
    hidden states unchanged."""

    def __init__(self, calls: dict[int, _Call], index: int) -> None:
        super().__init__()
        self.calls, self.index = calls, index

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls[self.index] = _Call(args, kwargs)
        return hidden


class _Zeros(nn.Module):
    """Stands in, on a stage without them, for the embeddings HF adds before the blocks (GPT-2's
    position embedding): a scalar zero, so the recording pass runs; its output is discarded."""

    def forward(self, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.get_default_dtype(), device=x.device)


@dataclass(frozen=True)
class Layout:
    """Where the parts of an HF causal LM are (names relative to the adapter)."""

    base: str  # the base model attribute ("model", "transformer")
    blocks: str  # the block container inside the base ("layers", "h")
    before: tuple[str, ...]  # base children with parameters that run before the blocks
    after: tuple[str, ...]  # base children with parameters that run after the blocks
    head: str  # the output embedding ("lm_head")
    n_layers: int


class HFCausalLM(nn.Module):
    """A `transformers` causal LM, split-able into pipeline stages; returns logits (or, on a
    stage without the head, hidden states)."""

    def __init__(self, hf_model: nn.Module, layout: Layout) -> None:
        super().__init__()
        self.add_module(layout.base, getattr(hf_model, layout.base))
        self.add_module(layout.head, hf_model.get_output_embeddings())
        object.__setattr__(self, "hf_config", hf_model.config)
        object.__setattr__(self, "hf_class", type(hf_model).__name__)
        object.__setattr__(self, "layout", layout)
        # the factor by which hidden states between blocks are split along the sequence (sequence
        # parallel), so that position ids span the whole sequence (`models.plan.sequence_shards`)
        self.sequence_shards = 1

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for token ids (batch, seq) — or hidden states on a pipeline stage without the
        head, from hidden states on a stage without the embeddings. `positions` (seq,): the
        tokens' true positions (context parallel holds non-contiguous chunks); default 0..T-1."""
        lay = self.layout
        base = getattr(self, lay.base)
        first = all(base._modules.get(name) is not None for name in lay.before)
        blocks = base._modules[lay.blocks]
        calls: dict[int, _Call] = {}
        recorders = nn.ModuleList(_Recorder(calls, i) for i in range(lay.n_layers))
        stand_ins = {lay.blocks: recorders, **{n: nn.Identity() for n in lay.after}}
        if not first:
            stand_ins.update({n: _Zeros() for n in lay.before})
        if positions is None:
            length = tokens.shape[1] * (1 if first else self.sequence_shards)
            positions = torch.arange(length, device=tokens.device)
        inputs = {"input_ids": tokens} if first else {"inputs_embeds": tokens}
        with _swapped(base, stand_ins):
            hidden = base(**inputs, position_ids=positions.unsqueeze(0),
                          use_cache=False).last_hidden_state
        x = hidden if first else tokens
        for name, block in blocks._modules.items():
            call = calls[int(name)]
            out = block(x, *call.args, **call.kwargs)
            x = out[0] if isinstance(out, tuple) else out
        if all(base._modules.get(name) is not None for name in lay.after):
            for name in lay.after:
                x = base._modules[name](x)
        head = self._modules.get(lay.head)
        return head(x) if head is not None else x

    def to_hf(self) -> nn.Module:
        """The HF model class around these very modules (for export and comparisons)."""
        import transformers

        cls = getattr(transformers, self.hf_class)
        with torch.device("meta"):
            shell = cls(self.hf_config)
        setattr(shell, self.layout.base, getattr(self, self.layout.base))
        shell.set_output_embeddings(getattr(self, self.layout.head))
        return shell


@contextlib.contextmanager
def _swapped(module: nn.Module, replacements: dict[str, nn.Module]) -> Iterator[None]:
    saved = {name: module._modules.get(name) for name in replacements}
    module._modules.update(replacements)
    try:
        yield
    finally:
        module._modules.update(saved)

