"""Events and sinks: metrics.jsonl, TensorBoard, the rank-0 progress line."""

from shardwise.telemetry.events import EventLog, JsonlSink, TensorBoardSink

__all__ = ["EventLog", "JsonlSink", "TensorBoardSink"]
