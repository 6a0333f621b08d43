"""Corpus, tokenizer, user datasets of samples, global-index sampler and per-rank loaders."""

from shardwise.data.loader import EvalBatches, TrainBatches
from shardwise.data.prepare import PreparedData, prepare_data
from shardwise.data.sampler import BatchLayout, GlobalSampler, PackedSequences
from shardwise.data.samples import CollatedSamples, SampleData, stack_pairs

__all__ = ["BatchLayout", "CollatedSamples", "EvalBatches", "GlobalSampler", "PackedSequences",
           "PreparedData", "SampleData", "TrainBatches", "prepare_data", "stack_pairs"]
