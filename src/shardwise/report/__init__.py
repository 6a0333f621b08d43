"""`shardwise report`: a self-contained HTML page of plots and a summary, read back from the events
a run wrote to `RUN_DIR/metrics.jsonl`. Imports no torch: a report can be made on a laptop from a
run directory copied off a cluster."""

from __future__ import annotations

from pathlib import Path

from shardwise.telemetry.readback import Run, load_run

__all__ = ["Run", "build_report", "load_run"]


def build_report(paths: list[str], out_dir: Path | None = None) -> tuple[Path, list[Run]]:
    """Write `index.html` into `out_dir` (default: the first run's `report/`); with several runs,
    their loss and throughput curves are overlaid, the controlled comparison and its scorecard
    follow the summary, and each run gets its own section."""
    runs = [load_run(p) for p in paths]  # every input is checked before any plotting
    from shardwise.report import html
    from shardwise.report.canvas import safely
    from shardwise.report.curves import COMPARE_PLOTS
    from shardwise.report.plots import RUN_PLOTS
    from shardwise.report.summary import summary_rows

    compare = [safely(make, runs) for make in COMPARE_PLOTS]
    per_run = [(run, [safely(make, run) for make in RUN_PLOTS]) for run in runs]
    sections: tuple[str, ...] = ()
    if len(runs) > 1:  # may they be compared, and the scorecard (`shardwise compare`'s)
        from shardwise.compare import compare_runs, load_run_data
        from shardwise.report.scorecard import STYLE, comparison_section

        comparison = compare_runs([load_run_data(p, require_record=False) for p in paths])
        sections = (comparison_section(comparison),)
    page = html.render(runs, summary_rows(runs), compare, per_run, sections,
                       STYLE if sections else "")
    out_dir = out_dir or runs[0].run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "index.html"
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(target)  # a reader never sees half a page
    return target, runs
