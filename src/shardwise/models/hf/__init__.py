"""Hugging Face `transformers` causal LMs as shardwise models (`model.family = "hf"`); imported
only when a spec asks for one, so shardwise runs without transformers."""
