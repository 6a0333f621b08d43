"""Rank 0's one-line view of the run: a rich progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressSink:
    def __init__(self, total_steps: int, start_step: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.live = self.console.is_terminal
        self._progress: Progress | None = None
        self.total = total_steps
        self.unit = "tok/s"  # "targets/s" for datasets of samples (run_start says which)
        if self.live:
            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} {task.fields[unit]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="-", tps="-", unit=self.unit)
            self._progress.start()

    def write(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "run_start" and event.get("tokens_per_step") is None:
            self.unit = "targets/s"
            if self._progress is not None:
                self._progress.update(self._task, unit=self.unit)
        if kind == "step":
            loss, tps = f"{event['loss']:.4f}", f"{event['tokens_per_s']:,.0f}"
            if self._progress is not None:
                self._progress.update(self._task, completed=event["step"], loss=loss, tps=tps)
            else:
                eta = event.get("eta_s")
                eta_text = f" eta {eta:.0f}s" if eta is not None else ""
                self.console.print(f"step {event['step']}/{self.total} loss {loss} "
                                   f"lr {event['lr']:.2e} grad_norm {event['grad_norm']:.3f} "
                                   f"{tps} {self.unit}{eta_text}", highlight=False)
        elif kind == "eval":
            self._print(f"[bold]eval[/] step {event['step']}: {held_out_text(event)}")
        elif kind == "straggler":
            self._print(f"[bold yellow]straggler[/] at step {event['step']}: {event['message']}")
        elif kind == "checkpoint":
            self._print(f"checkpoint step {event['step']} -> {event['path']} "
                        f"({event['save_seconds']:.2f} s)")

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, highlight=False)
        else:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        sys.stderr.flush()


def held_out_text(event: dict[str, Any]) -> str:
    """"held-out loss L, accuracy A% vs <baseline> baseline B" from an eval or run_end event
    (accuracy where the outputs score classes; the baseline where the data has one)."""
    text = f"held-out loss {event['val_loss']:.4f}"
    if event.get("val_accuracy") is not None:
        text += f", accuracy {100 * event['val_accuracy']:.1f}%"
    if event.get("unigram_loss") is not None:
        text += f" vs {event.get('baseline') or 'unigram'} baseline {event['unigram_loss']:.4f}"
    return text
