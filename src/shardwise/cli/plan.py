"""`shardwise plan --model NAME|FILE --cluster NAME|FILE`: choose the layout before booking the cluster.

`shardwise plan --calibrate RUN_DIR...`: the planner's error on runs that happened, and the
efficiency, overlap and framework-overhead coefficients that fit their step times
(`shardwise.planner.calibrate`), with the fit's error in-sample and leave-one-out (each
configuration predicted by a fit made without it); `--write-params` saves the fitted
`CostParams`, `--params` uses them (in planning and in calibration).

Exit codes: 0 with layouts that fit; 1 when none fits (with the smallest node count that would);
2 for a malformed cluster, model or parameters file, an unknown preset, a batch that cannot be
formed, or a run directory that cannot be calibrated on.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from shardwise.errors import SpecError, UserError

DEFAULT_REFERENCE = "benchmarks/published_runs.toml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from shardwise.planner.cluster import PRESETS as CLUSTERS
    from shardwise.planner.models import PRESETS as MODELS

    p = sub.add_parser(
        "plan", help="choose a parallel layout for a model on a cluster, before running it",
        description="Predict memory per rank, step time, tokens/s and MFU of every valid layout "
                    "of a model on a cluster, and print the best that fit.")
    p.add_argument("--model", default=None,
                   help=f"a preset ({', '.join(MODELS)}), a RunSpec .toml, or a Hugging Face "
                        "config.json (required unless --calibrate)")
    p.add_argument("--cluster", default=None,
                   help=f"a preset ({', '.join(CLUSTERS)}) or a cluster .toml (required unless "
                        "--calibrate, which defaults to cpu-local)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the cluster's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence "
                   "(default: the model's, or the RunSpec's data.seq_len)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", default=None, metavar="T",
                       help="tokens per optimizer step; K/M/G suffixes are powers of 2 "
                            "(16M = 16,777,216); rounded down to whole sequences")
    batch.add_argument("--global-batch", type=int, default=None, metavar="B",
                       help="sequences per optimizer step")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: the RunSpec's, else bf16 on GPUs and fp32 on CPUs")
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts to show (default 5)")
    p.add_argument("--json", action="store_true", help="print the top layouts as a JSON list")
    p.add_argument("--write-spec", default=None, metavar="PATH",
                   help="write the best layout shardwise runs today as a RunSpec TOML")
    p.add_argument("--params", default=None, metavar="FILE",
                   help="cost-model parameters (a TOML file --write-params wrote; default: the "
                        "built-in CostParams)")
    p.add_argument("--calibrate", nargs="+", default=None, metavar="RUN_DIR",
                   help="predict these finished runs, print the prediction error (memory and "
                        "step time) and fit efficiency, overlap and the framework overheads to "
                        "their step times, scored in-sample and leave-one-out")
    p.add_argument("--write-params", default=None, metavar="FILE",
                   help="with --calibrate: write the fitted CostParams as TOML")
    p.add_argument("--validate", nargs="?", const=DEFAULT_REFERENCE, default=None, metavar="FILE",
                   help="predict every published run of FILE (default "
                        f"{DEFAULT_REFERENCE}) at its own layout and print the MFU error; the "
                        "fit and its held-out score: python benchmarks/bench_plan.py --published")
    p.add_argument("--explain", default=None, metavar="LAYOUT",
                   help="break one layout's predicted step down term by term: its rank in the "
                        "table (1) or its name as printed, optionally with mbN and/or "
                        "none|selective|full (quote it); with --validate, a run id of the "
                        "reference set")
    p.add_argument("--tokens", default=None, metavar="T",
                   help="a token budget (K, M, B, T in powers of ten: 15T = 1.5e13 tokens): the "
                        "predicted days, device-hours, energy and cost of the top layouts")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.planner import report
    from shardwise.planner.accuracy import interval
    from shardwise.planner.cluster import resolve_cluster
    from shardwise.planner.costing import cost_lines
    from shardwise.planner.layout import Batch, not_run_today
    from shardwise.planner.search import search, smallest_cluster

    if args.top < 1:
        raise UserError(f"--top {args.top}: show at least one layout.")
    params = _params(args)
    if args.calibrate:
        return calibrate(args, params)
    if args.validate:
        return validate(args, params)
    if args.write_params:
        raise UserError("--write-params writes what --calibrate fitted: pass --calibrate RUN_DIR "
                        "as well.")
    for flag in ("model", "cluster"):
        if getattr(args, flag) is None:
            raise UserError(f"shardwise plan needs --{flag} (or --calibrate RUN_DIR... to check "
                            "the planner against finished runs).")
    cluster = resolve_cluster(args.cluster, args.nodes)
    model, base = resolve_model(args.model)
    if base is not None:  # a RunSpec says how its blocks run: torch.compile fuses their kernels
        params = dataclasses.replace(params, eager_modules=not base.memory.compile)
    if args.seq_len is not None and args.seq_len < 1:
        raise UserError(f"--seq-len {args.seq_len}: a sequence has at least one token.")
    seq = args.seq_len or (base.data.seq_len if base is not None and not base.data.is_samples
                           else model.seq_len) or 1
    global_batch = _global_batch(args, model, base, seq)
    precision = args.precision or (base.run.precision if base is not None else
                                   "fp32" if cluster.cluster.device == "cpu" else "bf16")
    batch = Batch(global_batch=global_batch, seq_len=seq, precision=precision,
                  tf32=base.run.tf32 if base is not None else True)
    tokens = _tokens(args)
    result = search(model, cluster, batch, params)
    band = (interval(cluster.device.generation, moe=model.moe)
            if cluster.cluster.device != "cpu" else None)
    out = sys.stdout
    if not result.feasible:
        nodes = smallest_cluster(model, cluster, batch)
        if args.json:
            print("[]", file=out)
        else:
            print(report.human(result, args.top), file=out)
        where = (f"the smallest {cluster.name} cluster that fits has {nodes:,} node(s) "
                 f"({nodes * cluster.devices_per_node:,} devices; found by doubling, then "
                 "bisecting)" if nodes else
                 f"no {cluster.name} cluster of up to 2,097,152 devices fits it at this batch "
                 "and sequence length (shorter sequences, a smaller batch per rank, or devices "
                 "with more memory)")
        print(f"error: no layout of {model.name} fits {cluster.nodes:,} {cluster.name} node(s) "
              f"for {batch.global_batch:,} x {batch.seq_len:,} tokens; {where}.", file=sys.stderr)
        return 1
    if args.json:
        print(report.layouts_json(result.top(args.top), band, cluster, tokens, model), file=out)
    else:
        print(report.human(result, args.top, band), file=out)
    if args.explain:  # with --json, stdout stays one JSON document: the words go to stderr
        _explain(args.explain, result, band, params, sys.stderr if args.json else out)
    if tokens and not args.json:
        print("\n" + "\n".join(cost_lines(result.top(args.top), cluster, tokens, band)), file=out)
    if args.write_spec:
        chosen = next((p for p in result.feasible if not not_run_today(p.layout, result.model)),
                      result.feasible[0])
        path = Path(args.write_spec).expanduser()
        text = report.spec_text(chosen, result, base)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as err:
            raise UserError(f"--write-spec {path}: cannot write it ({err}). Pick a writable "
                            "path.") from None
        print(f"wrote {path}: {chosen.layout.name()} "
              f"(check it with `shardwise train {path} --print-spec`)",
              file=sys.stderr if args.json else out)
    return 0


def _tokens(args: argparse.Namespace) -> float | None:
    from shardwise.planner.costing import parse_tokens

    if args.tokens is None:
        return None
    try:
        return parse_tokens(args.tokens)
    except ValueError:
        raise UserError(f"--tokens {args.tokens!r} is not a token budget: give a number of tokens "
                        "with an optional K, M, B or T suffix (powers of ten), like 15T or "
                        "300B.") from None


def _explain(wanted: str, result, band, params, out) -> None:
    """`--explain`: the layout's decomposition, or exit 2 naming the layouts there are."""
    from shardwise.planner import explain

    pred = explain.find(result.feasible, wanted) or explain.find(result.rejected, wanted)
    if pred is None:
        names = ", ".join(dict.fromkeys(p.layout.name() for p in result.top(5)))
        raise UserError(f"--explain {wanted!r}: no predicted layout has that rank or name. Give "
                        "a rank from the table (1 is the best) or a name as printed, like "
                        f"{names or 'zero2-8'}; add mbN or a recompute mode to pick one variant.")
    note = _efficiency_note(result.cluster, params)
    print("\n" + explain.explain(pred, result.cluster, band, note, params.eager_modules), file=out)


def _efficiency_note(cluster, params) -> str:
    """Which GEMM efficiency the decomposition's compute terms used, and whose fit it is."""
    from shardwise.planner.chip import fitted_efficiencies

    gen = cluster.device.generation
    if gen and cluster.cluster.device != "cpu":
        gemm, _, k_half, basis = fitted_efficiencies(params, gen)
        whose = (f"{gen}, fitted on published runs" if basis == gen else
                 f"{basis}'s fit on published runs: none is a {gen} run")
        return f"e = {gemm:.3g}, k0 = {k_half:.0f} ({whose})"
    return f"here FLOPs / (peak x efficiency {params.efficiency:.3g}): no device generation"


def _published_row(wanted: str, results):
    """The run `wanted` names for `--validate --explain`, or exit 2 naming the runs there are."""
    row = next((r for r in results if r.ref.id == wanted), None)
    if row is None:
        ids = [r.ref.id for r in results]
        raise UserError(f"--explain {wanted!r}: no run of this reference set has that id. With "
                        "--validate, --explain takes a run id from the table's first column, "
                        f"like {', '.join(ids[:3])} ({len(ids)} runs).")
    return row


def _explain_row(row, params, out) -> None:
    """`--validate --explain RUN`: one published run's predicted step, term by term, at the
    layout it was predicted at, with its source's stack."""
    from shardwise.planner import explain

    stack = row.ref.params(params)
    print(f"\n{row.ref.id} ({row.ref.source.id}): measured {100 * row.measured_mfu:.1f} % MFU, "
          f"predicted {100 * row.predicted_mfu:.1f} % ({row.error:+.1f} points)", file=out)
    print(explain.explain(row.prediction, row.ref.cluster, None,
                          _efficiency_note(row.ref.cluster, stack), stack.eager_modules),
          file=out)


def validate(args: argparse.Namespace, params) -> int:
    """`--validate`: every published run predicted at its own layout, and the error."""
    import json

    from shardwise.planner import published_report, validate

    path = Path(args.validate).expanduser()
    if not path.is_file():
        raise UserError(f"--validate {path}: no such file. Pass the reference set "
                        f"({DEFAULT_REFERENCE} in a shardwise checkout) or a file of the same "
                        "form.")
    refs = published_report.load(path)
    results = validate.predict_all(refs, params)
    row = _published_row(args.explain, results) if args.explain else None
    if args.json:
        print(json.dumps([{"run": r.ref.id, "source": r.ref.source.id,
                           "measured_mfu": r.measured_mfu, "predicted_mfu": r.predicted_mfu,
                           "error_points": r.error, "fits": r.any_fits, "layout": r.chosen()}
                          for r in results], indent=2))
    else:
        print(published_report.text(results, f"{len(refs)} published runs of {path}, each "
                                             "predicted at its own layout with "
                                             + (f"--params {args.params}" if args.params else
                                                "the built-in CostParams")))
    if row is not None:  # with --json, stdout stays one JSON document: the words go to stderr
        _explain_row(row, params, sys.stderr if args.json else sys.stdout)
    return 0


def _params(args: argparse.Namespace):
    from shardwise.planner.cost import DEFAULT_PARAMS
    from shardwise.planner.params_file import load_params

    return load_params(args.params) if args.params else DEFAULT_PARAMS


def calibrate(args: argparse.Namespace, params) -> int:
    """`--calibrate`: every run predicted with `params`, the errors, the fit, the errors after,
    in-sample and leave-one-out."""
    import dataclasses
    import json

    from shardwise.planner import calibrate as cal
    from shardwise.planner import measured, params_file
    from shardwise.planner.cluster import cpu_local, resolve_cluster

    runs = [measured.read_run(path) for path in args.calibrate]  # every directory checked first
    base = resolve_cluster(args.cluster or "cpu-local", args.nodes)
    cases = []
    for run in runs:
        dims, _ = _from_runspec(run.path / "spec.toml")
        cases.append((run, dims, measured.cluster_for(base, run.world, cpu_local)))
    before = [measured.evaluate(r, m, c, params) for r, m, c in cases]
    predictions = cal.PredictionCache(cases)
    fitted = cal.fit(cases, params, predictions)
    after = [measured.evaluate(r, m, c, fitted) for r, m, c in cases]
    loo = cal.leave_one_out(cases, params, predictions)
    loo_err = loo.errors(cases) if loo else [None] * len(cases)
    mape = {"model_state": measured.mean_abs([e.model_state_error for e in before]),
            "peak": measured.mean_abs([e.peak_error for e in before])}
    step = {"before": measured.mean_abs([e.step_time_error for e in before]),
            "after": measured.mean_abs([e.step_time_error for e in after]),
            "loo": measured.mean_abs(loo_err) if loo else None}
    rho = {"before": cal.config_spearman(cases, [e.step_time_pred for e in before]),
           "after": cal.config_spearman(cases, [e.step_time_pred for e in after]),
           "loo": cal.config_spearman(cases, loo.step_time_pred) if loo else None,
           "configurations": len({cal.config_key(r) for r in runs})}
    if args.write_params:
        path = Path(args.write_params).expanduser()
        header = [f"written by `shardwise plan --calibrate` from {len(runs)} run(s) on "
                  f"{base.name}: step-time mean absolute error {100 * step['before']:.1f} % "
                  f"before, {100 * step['after']:.1f} % after (in-sample)"
                  + (f", {100 * step['loo']:.1f} % leave-one-out" if loo else ""),
                  *(f"  {r.path}" for r in runs)]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(params_file.params_to_toml(fitted, header), encoding="utf-8")
        except OSError as err:
            raise UserError(f"--write-params {path}: cannot write it ({err}). Pick a writable "
                            "path.") from None
    if args.json:
        rows = []
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            row = b.as_dict()
            row["step_time_s"]["fitted"] = a.step_time_pred
            row["step_time_s"]["error_fitted"] = a.step_time_error
            row["step_time_s"]["loo"] = loo.step_time_pred[i] if loo else None
            row["step_time_s"]["error_loo"] = loo_err[i]
            row["overhead_s"] = {"predicted": b.prediction.overhead_s,
                                 "fitted": a.prediction.overhead_s}
            rows.append(row)
        print(json.dumps({"cluster": base.name, "runs": rows, "mape": mape,
                          "step_time_mape": step, "step_time_spearman": rho,
                          "params_before": dataclasses.asdict(params),
                          "params_after": dataclasses.asdict(fitted)}, indent=2))
    else:
        print(_calibration_text(base.name, before, after, loo_err, mape, step, rho, params,
                                fitted))
    if args.write_params:
        print(f"wrote {args.write_params}: use it with `shardwise plan --params "
              f"{args.write_params}`", file=sys.stderr if args.json else sys.stdout)
    return 0


def _calibration_text(cluster: str, before, after, loo_err, mape, step, rho, params,
                      fitted) -> str:
    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    def mib(x) -> str:
        return "-" if x is None else f"{x / 2**20:,.1f}"

    head = ["run", "layout", "state MiB pred/meas", "err", "peak MiB pred/meas", "err",
            "step s pred/fitted/meas", "err before", "after", "loo"]
    rows = [head]
    for b, a, lo in zip(before, after, loo_err, strict=True):
        r = b.run
        rows.append([r.path.name, f"{r.layout.name()} mb{r.layout.micro_batch}"
                     + (f" {r.layout.recompute}" if r.layout.recompute != "none" else ""),
                     f"{mib(b.model_state_pred)}/{mib(r.model_state_bytes)}",
                     pct(b.model_state_error), f"{mib(b.peak_pred)}/{mib(r.peak_bytes)}",
                     pct(b.peak_error),
                     f"{b.step_time_pred:.3g}/{a.step_time_pred:.3g}/{r.step_time_s:.3g}",
                     pct(b.step_time_error), pct(a.step_time_error), pct(lo)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"calibrating on {len(before)} run(s), cluster {cluster} (peak on a CPU: peak RSS "
             "minus RSS before the model, against the prediction less its runtime overhead)", ""]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
              for row in rows]

    def mean(x) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    def corr(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    changed = [f"{f.name} {getattr(params, f.name):.3g} -> {getattr(fitted, f.name):.3g}"
               for f in dataclasses.fields(params)
               if f.name not in ("efficiency", "overlap")
               and getattr(params, f.name) != getattr(fitted, f.name)]
    lines += ["", f"mean absolute error: model state {mean(mape['model_state'])}, peak "
                  f"{mean(mape['peak'])}; step time {mean(step['before'])} before fitting, "
                  f"{mean(step['after'])} after (in-sample), {mean(step['loo'])} leave-one-out",
              f"Spearman of step time over {rho['configurations']} configuration(s): "
              f"{corr(rho['before'])} before fitting, {corr(rho['after'])} after (in-sample), "
              f"{corr(rho['loo'])} leave-one-out (each configuration, with its repeats, "
              "predicted by a fit made without it)",
              f"fitted: efficiency {params.efficiency:.3g} -> {fitted.efficiency:.3g}, overlap "
              f"{params.overlap:.3g} -> {fitted.overlap:.3g}"
              + "".join(f", {c}" for c in changed) + " (least squares on log step time)"]
    return "\n".join(lines)


_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _global_batch(args: argparse.Namespace, model, base, seq: int) -> int:
    if args.global_batch is not None:
        if args.global_batch < 1:
            raise UserError(f"--global-batch {args.global_batch}: at least one sequence per step.")
        return args.global_batch
    if args.global_batch_tokens is not None:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)\s*", str(args.global_batch_tokens),
                             flags=re.IGNORECASE)
        if not match:
            raise UserError(f"--global-batch-tokens {args.global_batch_tokens!r} is not a number "
                            "of tokens like 4194304 or 4M.")
        tokens = int(float(match.group(1)) * _SUFFIX[match.group(2).upper()])
        if tokens < seq:
            raise UserError(f"--global-batch-tokens {args.global_batch_tokens} is less than one "
                            f"sequence of {seq} tokens.")
        return tokens // seq
    if base is not None:
        return base.batch.global_batch
    if model.default_global_batch:
        return model.default_global_batch
    raise UserError(f"{model.name} states no batch size: pass --global-batch (sequences) or "
                    "--global-batch-tokens.")


def resolve_model(name: str):
    """(ModelDims, the RunSpec it came from or None) for a preset, a RunSpec .toml or a
    Hugging Face config.json."""
    from shardwise.planner.hf_config import dims_from_hf_config
    from shardwise.planner.models import PRESETS, preset

    if name in PRESETS:
        return preset(name), None
    path = Path(name).expanduser()
    if name.endswith(".json") or (path.is_dir() and (path / "config.json").is_file()):
        return dims_from_hf_config(path / "config.json" if path.is_dir() else path), None
    if name.endswith(".toml"):
        return _from_runspec(path)
    if path.exists():
        raise SpecError(f"--model {name}: not a .toml RunSpec or a .json Hugging Face config.")
    return preset(name), None  # names the presets, with a did-you-mean


def _from_runspec(path: Path):
    """The model of a RunSpec, through its plan's shape summary (built on the meta device)."""
    import dataclasses

    from shardwise.models.registry import describe_model
    from shardwise.planner.models import ModelDims
    from shardwise.spec import load_spec

    spec = load_spec(path)
    vocab = 0 if spec.data.is_samples else spec.data.vocab_size
    plan = describe_model(spec.model, vocab_size=vocab, seq_len=spec.data.seq_len)
    family = spec.model.family
    dims = ModelDims.from_shape(plan.shape, family if family != "gpt" else f"gpt ({path.name})",
                                tied=bool(plan.tied), supports_tp=plan.supports_tp,
                                supports_pp=plan.supports_pp, default_global_batch=spec.batch.global_batch)
    if not plan.blocks and not dims.opaque:  # nothing to cut or to recompute
        dims = dataclasses.replace(dims, supports_pp=False, supports_recompute=False)
    return dataclasses.replace(dims, source=str(path)), spec
