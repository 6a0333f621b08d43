"""Per-rank batches for training and evaluation, driven by a sample cursor that is the only state.

The cursor counts global samples consumed. Step batches start at the cursor, so a run resumed from
a checkpoint — at any data-parallel degree — reads exactly the samples the uninterrupted run would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from shardwise.data.sampler import BatchLayout, GlobalSampler, PackedSequences
from shardwise.data.samples import CollatedSamples
from shardwise.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]
Split = PackedSequences | CollatedSamples  # `batch(ids)`, `len()`, `targets_per_sample`


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch to the run's device without a host sync: a copy from pageable memory makes
    CUDA synchronise the stream first, a copy from pinned memory does not."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class TrainBatches:
    """Stateful: `state_dict()` is the data position (global samples consumed)."""

    def __init__(self, sequences: Split, seed: int, layout: BatchLayout,
                 dp_rank: int, device: torch.device) -> None:
        self.sequences = sequences
        self.sampler = GlobalSampler(len(sequences), seed)
        self.layout = layout
        self.dp_rank = dp_rank
        self.device = device
        self.consumed_samples = 0
        self.skips: list[tuple[int, int]] = []  # [start, end) sample ranges never to train on

    def skip(self, start: int, end: int) -> None:
        """Never train on global samples [start, end) (a batch that made training diverge);
        idempotent, so a range recorded twice (the checkpoint's and the run's record) is one."""
        if (start, end) not in self.skips:
            self.skips.append((start, end))

    def _jump_skips(self) -> None:
        """Move the cursor past every skipped range it is inside (a rollback to a checkpoint
        saved in the middle of the bad streak resumes inside the range, not at its start)."""
        moved = True
        while moved:
            moved = False
            for start, end in self.skips:
                if start <= self.consumed_samples < end:
                    self.consumed_samples, moved = end, True

    def step_indices(self) -> list[np.ndarray]:
        """Global sample indices of this rank's micro-batches for the next step."""
        self._jump_skips()
        return self.layout.rank_indices(self.consumed_samples, self.dp_rank)

    def next_step(self) -> tuple[list[Batch], int | None]:
        """This rank's micro-batches for the next step, and the step's global target count when
        the data knows it without looking (None: the step counts its real targets).

        Every token of a packed sequence is a target, so the global count is B·T; it is computed
        here, not communicated, because every rank knows the whole step's samples.
        """
        batches = [self._load(idx) for idx in self.step_indices()]  # (jumps skipped ranges)
        self.consumed_samples += self.layout.global_batch
        per_sample = self.sequences.targets_per_sample
        return batches, None if per_sample is None else self.layout.global_batch * per_sample

    def _load(self, global_indices: np.ndarray) -> Batch:
        x, y = self.sequences.batch(self.sampler.sequence_ids(global_indices))
        return to_device(x, self.device), to_device(y, self.device)

    def state_dict(self) -> dict[str, Any]:
        # skips as JSON text: DCP would flatten a list into keys that vary with its length
        return {"consumed_samples": self.consumed_samples, "seed": self.sampler.seed,
                "skips": json.dumps(self.skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.sampler.seed:
            raise UserError(
                f"the checkpoint was written with run.seed = {int(state['seed'])} but the spec now "
                f"says {self.sampler.seed}; the data order would change. Resume with "
                f"--set run.seed={int(state['seed'])}."
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.skips = [tuple(r) for r in json.loads(state.get("skips", "[]"))]


class EvalBatches:
    """The held-out set: the first `n` validation sequences in order, n = min(eval.batches x
    global_batch, the split's size) — the same sequences for every layout and degree.

    They are cut into micro-batches of `micro_batch` (the last may be shorter) and micro-batch j
    goes to data-parallel rank j mod D. Every rank runs the same number of forward passes, because
    sharded and pipelined forwards are collectives: a rank with fewer real micro-batches re-runs
    its first one, marked as padding, so it is not counted.
    """

    def __init__(self, sequences: Split, layout: BatchLayout, batches: int,
                 dp_rank: int, device: torch.device) -> None:
        self.num = min(batches * layout.global_batch, len(sequences))
        if self.num == 0:
            raise UserError(
                "the validation split is empty: the corpus is too short for one held-out "
                "sequence of data.seq_len tokens. Raise data.val_fraction, shorten "
                "data.seq_len, or use a larger corpus."
            )
        self.sequences = sequences
        self.micro_batch = layout.micro_batch
        self.dp = layout.dp
        self.dp_rank = dp_rank
        self.device = device

    def _micro_batches(self) -> list[np.ndarray]:
        return [np.arange(start, min(start + self.micro_batch, self.num))
                for start in range(0, self.num, self.micro_batch)]

    def __iter__(self) -> Iterator[tuple[Batch, bool]]:
        """(batch, real) pairs: this rank's micro-batches, then padding up to the rounds that
        the rank with the most micro-batches runs."""
        all_batches = self._micro_batches()
        mine = all_batches[self.dp_rank::self.dp]
        rounds = -(-len(all_batches) // self.dp)
        for i in range(rounds):
            real = i < len(mine)
            idx = mine[i] if real else (mine[0] if mine else all_batches[0])
            x, y = self.sequences.batch(idx)
            yield (to_device(x, self.device), to_device(y, self.device)), real
