"""Corpus, tokenizer, user datasets of samples, global-index sampler and per-rank loaders."""

from shardwise.data.loader import EvalBatches, TrainBatches
from shardwise.data.prepare import PreparedData, check_vocab_fits, prepare_data
from shardwise.data.sampler import BatchLayout, GlobalSampler, PackedSequences
from shardwise.data.samples import CollatedSamples, SampleData, stack_pairs
from shardwise.data.tokenizer import resolve_tokenizer

__all__ = ["BatchLayout", "CollatedSamples", "EvalBatches", "GlobalSampler", "PackedSequences",
           "PreparedData", "SampleData", "TrainBatches", "check_vocab_fits", "prepare_data",
           "resolve_tokenizer", "stack_pairs"]
