"""`shardwise.train(...)`: the same run `shardwise train` makes, from Python.

    import shardwise

    def build(args, vocab_size):          # at the top level of a file: every worker imports it
        return MyModel(vocab_size, **args)

    if __name__ == "__main__":
        run_dir = shardwise.train("my.toml", model=build, overrides=["parallel.zero=3"])

Under torchrun every rank runs the script and `train` joins the launcher's world; otherwise it
starts `parallel.nproc` local workers as the CLI does. A builder function given as `model` is
recorded as `model.family = "py:FILE:NAME"` (so the spec, the manifest and a resume name it);
`model_args` fills `model.args`. Likewise a dataset function `data(args) -> SampleData` becomes
`data.source = "py:FILE:NAME"`, with `data_args` in `data.args`, and each of `hooks` (functions
`setup(trainer)` that add hooks with `trainer.add_hook(fn, every=N)`) an entry of `run.hooks`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from shardwise.errors import UserError
from shardwise.spec.runspec import RunSpec


def train(spec: RunSpec | str | Path | None = None, *, model: Callable[..., Any] | None = None,
          model_args: Mapping[str, Any] | None = None, data: Callable[..., Any] | None = None,
          data_args: Mapping[str, Any] | None = None, overrides: Iterable[str] = (),
          resume: str | Path | None = None,
          hooks: Iterable[Callable[..., Any]] = ()) -> Path:
    """Train; returns the run directory. `spec`: a RunSpec, a TOML path, or None (defaults).
    `hooks`: functions `setup(trainer)`, each at the top level of a file, that every rank calls
    before the first step to add hooks (`trainer.add_hook(fn, every=N)`); recorded in
    `run.hooks` so a resume runs them again."""
    from shardwise.parallel.distributed import under_launcher
    from shardwise.run import rundir
    from shardwise.spec import load_spec

    overrides = list(overrides)
    if resume is not None:
        run_dir = rundir.existing_run_dir(str(resume))
        resolved = rundir.load_run_spec(run_dir, overrides)
    elif isinstance(spec, RunSpec):
        resolved = spec
        if overrides:
            raise UserError("pass overrides with a TOML path (or apply them to the RunSpec with "
                            "RunSpec.replace); a RunSpec object is already resolved.")
    else:
        resolved = load_spec(spec, overrides)
    if model is not None:
        resolved = resolved.replace("model", family=family_of(model, "model"),
                                    args=dict(model_args or resolved.model.args))  # a builder
    elif model_args is not None:
        resolved = resolved.replace("model", args=dict(model_args))
    if data is not None:
        resolved = resolved.replace("data", source=family_of(data, "data"),
                                    args=dict(data_args or resolved.data.args))
    elif data_args is not None:
        resolved = resolved.replace("data", args=dict(data_args))
    hooks = list(hooks)
    if hooks:
        resolved = resolved.replace("run", hooks=tuple(family_of(h, "hooks") for h in hooks))
    resolved = resolved.validate()
    if under_launcher():
        from shardwise.run.worker import run_under_torchrun

        run_under_torchrun(resolved, None if resume is None else str(resume))
        return Path(resolved.run.dir) if resolved.run.dir else Path.cwd()
    from shardwise.run.launch import launch

    return launch(resolved, None if resume is None else str(resume))


def family_of(builder: Callable[..., Any], argument: str = "model") -> str:
    """`py:FILE:NAME` for a function defined at the top level of a Python file."""
    name = getattr(builder, "__qualname__", "")
    file = inspect.getsourcefile(builder) if callable(builder) else None
    if not file or not name or "." in name or "<" in name:
        raise UserError(
            f"{argument}={builder!r}: the function must be defined at the top level of a "
            "Python file (not a lambda, a method or a nested function), so that every worker "
            "can import it by file and name.")
    return f"py:{Path(file).resolve()}:{name}"
