"""Corpus, tokenizer, global-index sampler and per-rank loaders."""

from shardwise.data.loader import EvalBatches, TrainBatches
from shardwise.data.prepare import PreparedData, prepare_data
from shardwise.data.sampler import BatchLayout, GlobalSampler, PackedSequences

__all__ = ["BatchLayout", "EvalBatches", "GlobalSampler", "PackedSequences", "PreparedData",
           "TrainBatches", "prepare_data"]
