"""Every tensor that shardwise hands to a collective is created on the run's device.

NCCL has no CPU tensors: a flag or header built with `torch.zeros(1)` and all-reduced over an nccl
group kills a multi-GPU run at start-up, yet passes every CPU/gloo test. This lint makes that class
of bug fail CI: in any function of `src/shardwise` that calls a torch.distributed collective, every
tensor factory call must say `device=`. (At run time the comm tap also refuses a tensor on a device
the group's backend does not serve, naming the call — `telemetry.comm.BackendDeviceError`.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.specs import ROOT

COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
    "batch_isend_irecv", "all_gather_flat",
}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand"}


def _called(node: ast.Call) -> tuple[str | None, str]:
    func = node.func
    if isinstance(func, ast.Attribute):
        owner = func.value
        name = owner.id if isinstance(owner, ast.Name) else \
            owner.attr if isinstance(owner, ast.Attribute) else None
        return name, func.attr
    if isinstance(func, ast.Name):
        return None, func.id
    return None, ""


def violations(source: str, filename: str) -> list[str]:
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        if not any(_called(c)[1] in COLLECTIVES and _called(c)[0] in ("dist", "distributed", None)
                   for c in calls):
            continue
        for call in calls:
            owner, name = _called(call)
            if owner == "torch" and name in FACTORIES and \
                    not any(k.arg == "device" for k in call.keywords):
                found.append(f"{filename}:{call.lineno} torch.{name}(...) without device= in "
                             f"{fn.name}(), which calls a collective")
    return found


def test_collective_tensors_are_created_on_the_run_device():
    problems = []
    for path in sorted((ROOT / "src" / "shardwise").rglob("*.py")):
        problems += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems) + (
        "\nCreate these tensors with device=ctx.device (the run's device): the backend may be "
        "NCCL, which has no CPU tensors.")


def test_the_lint_catches_the_bug_it_is_for():
    bad = "import torch\nimport torch.distributed as dist\n" \
          "def flag(error):\n    t = torch.tensor([1 if error else 0])\n    dist.all_reduce(t)\n"
    good = bad.replace("else 0])", "else 0], device=device)")
    assert violations(bad, "x.py") and not violations(good, "x.py")
    assert Path(__file__).name  # the lint itself lives in the default test run
