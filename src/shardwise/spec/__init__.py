"""RunSpec: the typed, validated description of a run. Imports no torch."""

from shardwise.spec.load import load_spec, parse_override, spec_from_dict, spec_to_toml
from shardwise.spec.runspec import RunSpec

__all__ = ["RunSpec", "load_spec", "parse_override", "spec_from_dict", "spec_to_toml"]
