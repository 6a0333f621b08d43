"""`shardwise report` and the optional sinks: a report from synthetic events that use every field,
from a real 2-rank run, two runs overlaid, bad inputs; the page in a real headless browser;
Prometheus scraped over HTTP; MLflow through a recording stand-in module."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import types
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shardwise.cli.main import main
from shardwise.report import load_run
from shardwise.report.canvas import DPI, WIDTH_IN, plot_id
from shardwise.report.curves import COMPARE_PLOTS
from shardwise.report.plots import RUN_PLOTS
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.specs import tiny_spec_dict

PLOT_IDS = [plot_id(p) for p in (*COMPARE_PLOTS, *RUN_PLOTS)]


# --- synthetic events ---------------------------------------------------------------------------

def _step(step: int, t: float, loss: Any, world: int = 4, slow: int | None = 2) -> dict[str, Any]:
    base = [0.10 + 0.001 * r for r in range(world)]
    compute = [b * (1.6 if r == slow else 1.0) for r, b in enumerate(base)]
    return {
        "kind": "step", "run_id": "synth", "rank": 0, "step": step, "time": t, "loss": loss,
        "lr": 1e-3 * min(step, 3) / 3, "grad_norm": 1.0 / step, "tokens_per_s": 9000.0 + step,
        "samples_per_s": 70.0, "step_time_s": 0.2, "step_time_s_per_rank": [0.2] * world,
        "step_time_p50_s_per_rank": [0.2] * world, "step_time_p90_s_per_rank": [0.22] * world,
        "step_time_p99_s_per_rank": [0.25] * world, "compute_s_per_rank": compute,
        "data_wait_s": 0.001, "tokens_seen": 1024 * step, "eta_s": 10.0, "mfu": 0.31, "hfu": 0.4,
        "comm_bytes": 2_000_000, "comm_time_s": 0.02, "comm_bytes_per_rank": [2_000_000] * world,
        "comm_by_op": {"all_reduce:dp": {"calls": 2, "bytes": 1_500_000, "time_s": 0.015},
                       "all_gather:dp_shard": {"calls": 4, "bytes": 500_000, "time_s": 0.005},
                       "send:pp": {"calls": 8, "bytes": 64_000, "time_s": 0.002}},
        "comm_ratio_to_min": 1.05, "peak_mem_bytes": 3 * 2**30,
        "peak_mem_bytes_per_rank": [3 * 2**30 + r * 2**28 for r in range(world)],
        "bubble_fraction": 0.18, "bubble_fraction_theory": 0.2,
        "loss_scale": 65536.0 / (2 if step > 4 else 1),
        "moe_load_min": 40.0 - step, "moe_load_mean": 64.0, "moe_load_max": 90.0 + step,
        "moe_load_cv": 0.3 - 0.02 * step, "moe_aux_loss": 1.2 - 0.01 * step,
        "moe_dropped": 3.0, "moe_dropped_fraction": 0.0117, "moe_bias_abs_max": 0.001 * step,
        "moe_bias_abs_mean": 0.0005 * step,
    }


def _ev(kind: str, step: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "run_id": "synth", "rank": 0, "step": step, "time": t, **fields}


def synthetic_events(layout: str = "fsdp-4", loss_shift: float = 0.0) -> list[dict[str, Any]]:
    """Two launches of a 4-rank run with every kind and field the trainer writes: a straggler,
    a non-finite step and a rollback that re-runs steps 5-6, a hang report, then a restart."""
    t = 1_800_000_000.0
    start = dict(version="0.1.0", layout=layout, world_size=4,
                 mesh={"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}, device="cpu",
                 threads=1, model_params=106816, flops_per_token=688128.0, zero=3, accumulation=2,
                 tokens_per_step=1024, unigram_loss=5.24, peak_flops=1e12, flops_formula="6N+12LHQT")
    ev = [_ev("run_start", 0, t, **start),
          _ev("model_state", 1, t + 0.5, param_bytes_per_rank=[213632] * 4,
              grad_bytes_per_rank=[213632] * 4, optimizer_bytes_per_rank=[427344] * 4)]
    for s in range(1, 7):
        loss = "nan" if s == 5 else 6.0 - 0.2 * s + loss_shift
        ev.append(_step(s, t + s, loss))
        if s % 2 == 0:
            ev.append(_ev("eval", s, t + s + 0.1, val_loss=6.1 - 0.2 * s + loss_shift,
                          unigram_loss=5.24, eval_tokens=256))
        if s == 4:
            ev.append(_ev("checkpoint", 4, t + 4.3, path="/runs/synth/checkpoints/step-000004",
                          save_seconds=0.3, stall_s=0.05, write_s=0.25, bytes=10_000_000))
        if s == 5:
            ev.append(_ev("straggler", 5, t + 5.1, straggler_rank=2, ratio=1.6, compute_s=0.16,
                          median_s=0.1))
            ev.append(_ev("nonfinite", 5, t + 5.2, loss="nan", grad_norm="inf", consecutive=1))
    ev.append(_ev("rollback", 4, t + 6.5, path="/runs/synth/checkpoints/step-000004",
                  skipped_samples=[32, 40], bad_steps=1))
    for s in (5, 6):  # re-run after the rollback: these values replace the first ones
        ev.append(_step(s, t + 2 + s, 5.0 - 0.1 * s + loss_shift))
    ev.append(_ev("hang", 6, t + 9, report="rank 3 stuck in all_reduce:dp", ranks=[3]))
    # the second launch: resuming rejects a damaged checkpoint before the run starts again
    ev.append(_ev("checkpoint_rejected", 6, t + 20, path="/runs/synth/checkpoints/step-000008",
                  problems=["shard 1 sha256 mismatch"]))
    ev.append(_ev("resume", 6, t + 20.2, path="/runs/synth/checkpoints/step-000006",
                  from_layout=layout, from_world_size=4))
    ev.append(_ev("run_start", 6, t + 20.5, **start))
    ev.append(_ev("restart", 7, t + 22, attempt=1, resumed_from_step=6, seconds_to_first_step=2.0))
    for s in (7, 8):
        ev.append(_step(s, t + 15 + s, 4.3 - 0.1 * s + loss_shift, slow=None))
    ev.append(_ev("eval", 8, t + 23.2, val_loss=4.2 + loss_shift, unigram_loss=5.24, eval_tokens=256))
    ev.append(_ev("checkpoint", 8, t + 23.5, path="/runs/synth/checkpoints/step-000008",
                  save_seconds=0.2, stall_s=0.04, write_s=0.16, bytes=10_000_000))
    ev.append(_ev("run_end", 8, t + 24, wall_s=3.9, tokens_seen=8192, final_loss=3.5 + loss_shift,
                  val_loss=4.2 + loss_shift, unigram_loss=5.24, goodput=0.875, sample="ROMEO: ay"))
    return ev


def write_run(run_dir: Path, events: list[dict[str, Any]], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return run_dir


# --- reading the page back ----------------------------------------------------------------------

class Page(HTMLParser):
    """The images (id -> attributes), the summary table (label -> cells) and the plain text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: dict[str, dict[str, str]] = {}
        self.omitted: dict[str, str] = {}
        self.rows: dict[str, list[str]] = {}
        self.text: list[str] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._omitted_id: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "img":
            self.images[a["id"]] = a
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "p" and a.get("class") == "omitted":
            self._omitted_id = a["id"]
            self.omitted[a["id"]] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row:
            self.rows[self._row[0]] = self._row[1:]
            self._row = None
        elif tag == "p":
            self._omitted_id = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._omitted_id:
            self.omitted[self._omitted_id] += data


def check_images(page: Page) -> None:
    """Every image is a PNG that decodes, is 1000 px wide at the declared size."""
    for name, attrs in page.images.items():
        prefix = "data:image/png;base64,"
        assert attrs["src"].startswith(prefix), name
        image = Image.open(io.BytesIO(base64.b64decode(attrs["src"][len(prefix):])))
        image.load()  # decodes every pixel, so a truncated PNG fails here
        assert image.format == "PNG"
        assert image.size == (int(attrs["width"]), int(attrs["height"])), name
        assert image.size[0] == WIDTH_IN * DPI and image.size[1] >= 200, (name, image.size)


def report(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["report", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# --- tests --------------------------------------------------------------------------------------

def test_synthetic_run_report_has_summary_and_every_plot(tmp_path, capsys):
    run_dir = write_run(tmp_path / "synth", synthetic_events())
    code, out, _ = report(str(run_dir), capsys=capsys)
    assert code == 0 and str(run_dir / "report" / "index.html") in out
    html = (run_dir / "report" / "index.html").read_text()
    page = Page(html)
    assert sorted(page.images) == sorted(f"plot-{p}" for p in PLOT_IDS), page.omitted
    check_images(page)
    rows = page.rows
    assert rows["run"] == ["synth"] and rows["layout"] == ["fsdp-4"] and rows["world size"] == ["4"]
    assert rows["final train loss"] == ["3.5000"]  # run_end's final loss, at the last step
    assert rows["final held-out loss"] == ["4.2000 (unigram 5.2400)"]
    assert rows["tokens"] == ["8,192"] and rows["final step"] == ["8"]
    assert rows["mean MFU"] == ["31.0 %"] and rows["goodput"] == ["87.5 %"]
    assert rows["launches"] == ["2 (1 resumed, 1 restart events)"]
    assert rows["faults"] == ["1 straggler, 1 hang, 1 nonfinite, 1 rollback, 1 checkpoint rejected"]
    assert rows["wall time"] == ["13.0 s over 2 launches"]  # 9 s + 4 s: the downtime is not counted
    assert rows["expert balance"] == ["load CV 0.140, balance loss 1.120, 1.2 % dropped"]
    # self-contained: no script, no fetch of anything
    assert "<script" not in html and "http://" not in html and "https://" not in html
    # the re-run after the rollback replaces the first try of steps 5 and 6
    steps = load_run(str(run_dir)).steps()
    assert [e["step"] for e in steps] == list(range(1, 9))
    assert steps[4]["loss"] == pytest.approx(4.5)


def test_old_or_crashed_run_omits_plots_with_reasons(tmp_path, capsys):
    """A run from before MFU/comm/memory telemetry, cut off mid-line by a crash."""
    keep = {"kind", "run_id", "rank", "step", "time", "loss", "lr", "grad_norm", "tokens_per_s",
            "step_time_s", "step_time_s_per_rank", "tokens_seen"}
    events = [e for e in synthetic_events()[:12] if e["kind"] in ("run_start", "step", "eval")]
    events = [{k: v for k, v in e.items() if e["kind"] != "step" or k in keep} for e in events]
    run_dir = write_run(tmp_path / "old", events, tail='{"kind": "step", "run_id": "old", "ste')
    code, _, err = report(str(run_dir), capsys=capsys)
    assert code == 0
    assert "note: old: The last line of metrics.jsonl" in err and "cut off" in err
    page = Page((run_dir / "report" / "index.html").read_text())
    check_images(page)
    assert {"plot-loss", "plot-throughput", "plot-step-time", "plot-optimizer",
            "plot-timeline"} <= set(page.images)
    assert "no bubble_fraction" in page.omitted["plot-bubble"]
    assert "comm_by_op" in page.omitted["plot-comm"]
    assert "peak_mem_bytes" in page.omitted["plot-memory"]
    assert "no checkpoint event" in page.omitted["plot-checkpoint"]
    assert "not a mixture-of-experts run" in page.omitted["plot-experts"]
    assert page.rows["expert balance"] == ["—"]
    text = "".join(page.text)
    assert "MFU: not recorded by this run" in text and "cut off" in text
    assert page.rows["mean MFU"] == ["—"] and page.rows["goodput"] == ["—"]


@pytest.mark.grid  # 14 s; the real two-rank report stays in the default run
def test_two_runs_overlay_and_out_dir(tmp_path, capsys):
    a = write_run(tmp_path / "ddp", synthetic_events("ddp-4"))
    b = write_run(tmp_path / "tp", synthetic_events("tp2+dp2", loss_shift=0.05))
    out = tmp_path / "compare"
    code, _, _ = report(str(a), str(b / "metrics.jsonl"), "--out", str(out), capsys=capsys)
    assert code == 0 and not (a / "report").exists()
    page = Page((out / "index.html").read_text())
    check_images(page)
    assert page.rows["run"] == ["ddp", "tp"] and page.rows["layout"] == ["ddp-4", "tp2+dp2"]
    assert {"plot-loss", "plot-throughput", "plot-ddp-step-time", "plot-tp-step-time"} <= set(page.images)
    assert report(str(a), str(b), capsys=capsys)[0] == 0  # default: into the first run's dir
    assert (a / "report" / "index.html").is_file()


@pytest.mark.parametrize("case", ["missing", "no-metrics", "empty", "garbage", "plain-file"])
def test_bad_input_is_one_paragraph(case, tmp_path, capsys):
    target = tmp_path / "run"
    if case != "missing":
        target.mkdir()
    if case == "empty":
        (target / "metrics.jsonl").write_text("")
    if case == "garbage":
        (target / "metrics.jsonl").write_text("not json\n{\"kind\": ")
    if case == "plain-file":
        target = target / "notes.txt"
        target.write_text("hello")
    code, out, err = report(str(target), capsys=capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("error:") == 1
    expected = {"missing": "does not exist", "no-metrics": "has no metrics.jsonl",
                "empty": "is empty", "garbage": "has no readable event",
                "plain-file": "is a file, not a run directory"}[case]
    assert expected in " ".join(err.split())


def test_page_renders_in_headless_chromium(tmp_path, capsys):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install chromium); the HTML-parsing "
                    "tests above still check the page")
    run_dir = write_run(tmp_path / "synth", synthetic_events())
    assert report(str(run_dir), capsys=capsys)[0] == 0
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1100,2400", f"--screenshot={shot}",
         (run_dir / "report" / "index.html").as_uri()],
        capture_output=True, text=True, timeout=90)
    assert shot.is_file(), proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 2400)
    pixels = np.asarray(image).astype(int)
    ink = int((pixels.min(axis=2) < 200).sum())
    # saturated colour comes only from the plots (text and table are grey or black)
    colour = int((pixels.max(axis=2) - pixels.min(axis=2) > 80).sum())
    assert ink > 0.03 * 1100 * 2400, ink
    assert colour > 5000, colour


# --- a real run, with both optional sinks on ---------------------------------------------------

FAKE_MLFLOW = '''
"""A stand-in for mlflow that appends every call to $FAKE_MLFLOW_LOG as a JSON line."""
import json, os, uuid
from types import SimpleNamespace

def _log(fn, *args, **kwargs):
    with open(os.environ["FAKE_MLFLOW_LOG"], "a") as f:
        f.write(json.dumps({"fn": fn, "args": args, "kwargs": kwargs}, default=str) + "\\n")

def get_tracking_uri():
    return "file:///fake"

def set_experiment(name):
    _log("set_experiment", name)

def start_run(run_id=None, run_name=None):
    run_id = run_id or uuid.uuid4().hex
    _log("start_run", run_id=run_id, run_name=run_name)
    return SimpleNamespace(info=SimpleNamespace(run_id=run_id))

def log_params(params): _log("log_params", params)
def log_metrics(metrics, step=None): _log("log_metrics", metrics, step=step)
def set_tag(key, value): _log("set_tag", key, value)
def log_artifact(path): _log("log_artifact", path)
def log_text(text, artifact_file): _log("log_text", text, artifact_file)
def end_run(status="FINISHED"): _log("end_run", status=status)
'''


def _calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.grid  # 18 s; the synthetic reports stay in the default run
@pytest.mark.timeout(240)
def test_real_two_rank_run_report_and_sinks(small_corpus, tmp_path, capsys):
    fake = tmp_path / "fake"
    (fake / "mlflow").mkdir(parents=True)
    (fake / "mlflow" / "__init__.py").write_text(FAKE_MLFLOW)
    log = tmp_path / "mlflow-calls.jsonl"
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(
        small_corpus, run_dir, run={"steps": 4}, parallel={"nproc": 2}, eval={"every": 2},
        checkpoint={"enabled": True},
        telemetry={"mlflow": True, "prometheus_port": _free_port()})).validate()))
    env = {**os.environ, "FAKE_MLFLOW_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", str(config)], cwd=tmp_path,
                          env=env, text=True, capture_output=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "MLflow logging is off" not in proc.stderr and "not serving Prometheus" not in proc.stderr

    code, _, _ = report(str(run_dir), capsys=capsys)
    assert code == 0
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    end = next(e for e in events if e["kind"] == "run_end")
    page = Page((run_dir / "report" / "index.html").read_text())
    check_images(page)
    assert {"plot-loss", "plot-throughput", "plot-step-time", "plot-optimizer", "plot-checkpoint",
            "plot-timeline"} <= set(page.images)
    assert page.rows["world size"] == ["2"] and page.rows["final step"] == ["4"]
    assert page.rows["final train loss"] == [f"{end['final_loss']:.4f}"]
    assert page.rows["final held-out loss"][0].startswith(f"{end['val_loss']:.4f}")
    assert page.rows["tokens"] == [f"{end['tokens_seen']:,}"]
    assert "plot-bubble" in page.omitted  # no pipeline in this layout

    calls = _calls(log)  # rank 0 only: one run, started once, ended once
    fns = [c["fn"] for c in calls]
    assert fns.count("start_run") == 1 and fns[-1] == "end_run"
    assert calls[-1]["kwargs"]["status"] == "FINISHED"
    params = next(c for c in calls if c["fn"] == "log_params")["args"][0]
    assert params["run.steps"] == "4" and params["parallel.nproc"] == "2"
    logged_steps = [c["kwargs"]["step"] for c in calls
                    if c["fn"] == "log_metrics" and "step/loss" in c["args"][0]]
    assert logged_steps == [1, 2, 3, 4]
    assert any(c["fn"] == "log_artifact" and c["args"][0].endswith("manifest.json") for c in calls)
    assert any(c["fn"] == "log_text" and c["args"][0].strip().endswith("step-000004") for c in calls)
    assert json.loads((run_dir / "mlflow.json").read_text())["tracking_uri"] == "file:///fake"


def test_mlflow_sink_resumes_its_run_and_missing_mlflow_is_clear(tmp_path, monkeypatch):
    from shardwise.errors import UserError
    from shardwise.spec import RunSpec
    from shardwise.telemetry.optional import check_optional_sinks, optional_sinks

    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_MLFLOW_LOG", str(log))
    module = types.ModuleType("mlflow")
    exec(compile(FAKE_MLFLOW, "fake_mlflow", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "mlflow", module)
    spec = RunSpec().replace("telemetry", mlflow=True)
    for _ in range(2):  # a second launch in the same run dir continues the same MLflow run
        (sink,) = optional_sinks(spec.telemetry, tmp_path, spec.run.name, spec.to_dict())
        sink.write(_ev("step", 3, 1.0, loss=2.5, lr=0.1, step_time_s_per_rank=[1.0]))
        sink.close()
    starts = [c["kwargs"]["run_id"] for c in _calls(log) if c["fn"] == "start_run"]
    assert len(starts) == 2 and starts[0] == starts[1]
    assert [c["fn"] for c in _calls(log)].count("log_params") == 1
    assert next(c for c in _calls(log) if c["fn"] == "log_metrics")["args"][0] == {
        "step/loss": 2.5, "step/lr": 0.1}
    assert _calls(log)[-1]["kwargs"]["status"] == "FAILED"  # no run_end: the launch did not finish

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` sees when not installed
    with pytest.raises(UserError, match=r"pip install mlflow.*telemetry.mlflow=false"):
        check_optional_sinks(spec.telemetry)


def test_prometheus_serves_latest_step_metrics(tmp_path, capsys):
    from shardwise.spec import RunSpec
    from shardwise.telemetry.optional import optional_sinks
    from shardwise.telemetry.prometheus import PrometheusSink, start_prometheus

    port = _free_port()
    (sink,) = optional_sinks(RunSpec().replace("telemetry", prometheus_port=port).telemetry,
                             tmp_path, "r", {})
    assert isinstance(sink, PrometheusSink) and (sink.host, sink.port) == ("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        events = synthetic_events()
        for e in events[:10]:
            sink.write(e)
        for e in events[10:]:
            sink.write(e)
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        samples = {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1]
                   for line in text.splitlines() if line and not line.startswith("#")}
        last = [e for e in events if e["kind"] == "step"][-1]
        assert float(samples['shardwise_loss{run_id="synth"}']) == pytest.approx(last["loss"])
        assert samples['shardwise_step{run_id="synth"}'] == "8"
        assert samples['shardwise_val_loss{run_id="synth"}'] == "4.2"
        assert float(samples['shardwise_compute_s_per_rank{run_id="synth",rank="3"}']) == \
            pytest.approx(last["compute_s_per_rank"][3])
        assert samples['shardwise_comm_bytes_by_op{run_id="synth",op="all_reduce",axis="dp"}'] == "1500000"
        assert samples['shardwise_events_total{run_id="synth",kind="straggler"}'] == "1"
        assert "# TYPE shardwise_loss gauge" in text
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        assert err.value.code == 404
        # a port in use is a warning, not a failed run
        assert start_prometheus("127.0.0.1", port) is None
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    finally:
        sink.close()
        sink.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
