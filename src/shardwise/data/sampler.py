"""Global-index sampling: which sample each rank reads at each step, from the step number alone.

Global sample index i (0, 1, 2, … across the whole run) maps to a packed sequence through a keyed
permutation of (seed, epoch) — never through the world size. Step k owns global indices
[k·B, (k+1)·B) for global batch B, cut into micro-batches of m consecutive indices; micro-batch j
goes to data-parallel rank j mod D. Resuming at step k therefore needs nothing but k.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from shardwise.errors import SpecError


class GlobalSampler:
    """Global sample index -> sequence id, a fresh keyed permutation per epoch."""

    def __init__(self, num_sequences: int, seed: int) -> None:
        if num_sequences <= 0:
            raise ValueError("no sequences to sample from")
        self.num_sequences = num_sequences
        self.seed = seed

    @lru_cache(maxsize=2)  # noqa: B019 - two epochs live at a boundary; the sampler lives all run
    def _perm(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(self.num_sequences)

    def sequence_ids(self, global_indices: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(global_indices, self.num_sequences)
        out = np.empty_like(global_indices)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[offsets[mask]]
        return out


@dataclass(frozen=True)
class BatchLayout:
    """How one step's global batch is split: micro-batches per rank and their global indices."""

    global_batch: int
    micro_batch: int
    dp: int

    @classmethod
    def checked(cls, global_batch: int, micro_batch: int, dp: int) -> BatchLayout:
        per_step = micro_batch * dp
        if global_batch % per_step:
            lower = max(per_step, global_batch // per_step * per_step)
            other = (f", or a micro_batch that divides {global_batch // dp}"
                     if global_batch % dp == 0 else "")
            raise SpecError(
                f"batch.global_batch ({global_batch}) is not a multiple of batch.micro_batch "
                f"({micro_batch}) * data-parallel degree ({dp}) = {per_step}, so ranks would get "
                f"unequal work. Use global_batch {lower} or {lower + per_step}{other}."
            )
        return cls(global_batch, micro_batch, dp)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step, all ranks together."""
        return self.global_batch // self.micro_batch

    @property
    def accumulation(self) -> int:
        """Micro-batches each rank runs per step (gradient accumulation)."""
        return self.micro_batches // self.dp

    def rank_indices(self, start: int, dp_rank: int) -> list[np.ndarray]:
        """Global sample indices of each micro-batch that `dp_rank` runs in the step whose
        first global sample index is `start` (step k of a constant batch: start = k·B)."""
        return [
            np.arange(start + j * self.micro_batch, start + (j + 1) * self.micro_batch)
            for j in range(dp_rank, self.micro_batches, self.dp)
        ]


class PackedSequences:
    """Fixed-length windows of a token stream: sequence s is tokens[s·T : s·T + T + 1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_sequences = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.num_sequences

    @property
    def targets_per_sample(self) -> int:
        return self.seq_len  # every token of a packed sequence is a real target

    def batch(self, sequence_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(ids), seq_len) int64; targets are inputs shifted by one."""
        t = self.seq_len
        rows = np.stack([np.asarray(self.tokens[s * t: s * t + t + 1], dtype=np.int64)
                         for s in sequence_ids])
        data = torch.from_numpy(rows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()
