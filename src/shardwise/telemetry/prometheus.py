"""Rank 0 serves the latest step metrics at `http://HOST:PORT/metrics` in Prometheus' text format.

A stdlib HTTP server in a daemon thread: no prometheus_client dependency, and a scrape never
touches the training thread beyond a lock around a dict. Names follow the event fields
(`shardwise_<field>`), per-rank lists become one sample per `rank` label, `comm_by_op` one per
`op` and `axis`, and every other event kind is a counter `shardwise_events_total{kind=...}`.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SKIP = frozenset({"kind", "run_id", "rank", "time"})


class PrometheusSink:
    """Keeps the newest value of every numeric field of `step` and `eval` events; `port=0` binds a
    free port (tests), read back from `.port`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._counts: dict[str, int] = {}
        self._run_id = ""
        self._closed = False
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = sink.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds must not print on rank 0's console

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="prometheus",
                                        daemon=True)
        self._thread.start()

    def write(self, event: dict[str, Any]) -> None:
        kind = str(event.get("kind", ""))
        with self._lock:
            self._run_id = str(event.get("run_id", self._run_id))
            self._counts[kind] = self._counts.get(kind, 0) + 1
            if kind not in ("step", "eval"):
                return
            self._set("step", (), event.get("step"))
            self._set("last_event_timestamp_seconds", (), event.get("time"))
            for key, value in event.items():
                if key in _SKIP or key == "step":
                    continue
                if isinstance(value, list):
                    for rank, v in enumerate(value):
                        self._set(key, (("rank", str(rank)),), v)
                elif isinstance(value, dict) and key == "comm_by_op":
                    for name, rec in value.items():
                        op, _, axis = str(name).partition(":")
                        if isinstance(rec, dict):
                            for field, v in rec.items():
                                self._set(f"comm_{field}_by_op", (("op", op), ("axis", axis)), v)
                else:
                    self._set(key, (), value)

    def _set(self, name: str, labels: tuple[tuple[str, str], ...], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            return
        try:
            number = float(value)  # non-finite values arrive as floats or as "nan"/"inf" strings
        except ValueError:
            return
        self._gauges[(_metric_name(name), labels)] = number

    def render(self) -> str:
        """The exposition text: one `# TYPE` line per metric, then its samples."""
        with self._lock:
            gauges, counts, run_id = dict(self._gauges), dict(self._counts), self._run_id
        base = (("run_id", run_id),)
        lines: list[str] = []
        typed: set[str] = set()
        for (name, labels), value in sorted(gauges.items()):
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name}{_labels(base + labels)} {_value(value)}")
        if counts:
            lines.append("# HELP shardwise_events_total Events written since this process started.")
            lines.append("# TYPE shardwise_events_total counter")
            for kind, n in sorted(counts.items()):
                lines.append(f"shardwise_events_total{_labels((*base, ('kind', kind)))} {n}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Stop serving and free the port (idempotent: a hang report closes the sinks early)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_prometheus(host: str, port: int) -> PrometheusSink | None:
    """The sink, or None with a warning when the port cannot be bound: metrics are worth a warning,
    not a training run (and only rank 0 would fail, leaving the others waiting)."""
    try:
        return PrometheusSink(host, port)
    except OSError as err:
        print(f"warning: not serving Prometheus metrics: cannot listen on {host}:{port} "
              f"({err.strerror or err}). Pick a free telemetry.prometheus_port, or 0 to turn it "
              "off.", file=sys.stderr)
        return None


def _metric_name(field: str) -> str:
    return "shardwise_" + re.sub(r"[^a-zA-Z0-9_]", "_", field)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs) + "}"


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v) if not v.is_integer() or abs(v) >= 1e15 else str(int(v))
