"""Topology: parallel degrees, the named device mesh, and `parallelize` — where layouts are applied."""

from shardwise.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
