"""Build a run from a RunSpec: trainer loop, hooks, workers and local launch."""
