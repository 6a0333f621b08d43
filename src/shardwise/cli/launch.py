"""`shardwise launch CONFIG --nnodes N --nproc-per-node G --rdzv-endpoint HOST:PORT [--exec]` and
`shardwise launch CONFIG --slurm --nodes N --gpus-per-node G [...] [--dry-run]`."""

from __future__ import annotations

import argparse
import sys

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run on a cluster: one node's torchrun command, or a Slurm job",
        description="Print (with --exec, run) the torchrun command of one node of a multi-node "
                    "job, or write a Slurm batch script into the run directory and submit it. "
                    "The resolved spec goes to RUN_DIR/job.toml; every node must see RUN_DIR.")
    p.add_argument("config", nargs="?", help="RunSpec TOML file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=V", help="override one spec field (repeatable)")
    p.add_argument("--nnodes", type=int, help="machines in the job (torchrun)")
    p.add_argument("--nproc-per-node", type=int,
                   help="workers per machine (default: --gpus-per-node, else 1)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="c10d rendezvous: the first node's address and a free port")
    p.add_argument("--node-rank", type=int,
                   help="this node's index; 0 hosts the rendezvous store (without it: the node "
                        "the endpoint names; required when all nodes run on this machine)")
    p.add_argument("--exec", dest="execute", action="store_true",
                   help="run the command instead of printing it; exits 75 when preempted")
    p.add_argument("--slurm", action="store_true", help="write and submit an sbatch script")
    p.add_argument("--nodes", type=int, help="Slurm: nodes to allocate")
    p.add_argument("--gpus-per-node", type=int, default=0, help="Slurm: GPUs per node (0: CPU)")
    p.add_argument("--partition", default="", help="Slurm partition")
    p.add_argument("--time", default="", help="Slurm time limit (e.g. 04:00:00)")
    p.add_argument("--account", default="", help="Slurm account")
    p.add_argument("--requeue", action="store_true",
                   help="Slurm: requeue the job after a preemption (it resumes)")
    p.add_argument("--rdzv-port", type=int, default=0,
                   help="Slurm: rendezvous port on the first node (default 29400 + job id %% 1000)")
    p.add_argument("--dry-run", action="store_true", help="Slurm: write the script, submit nothing")
    p.add_argument("--assume-shared", action="store_true",
                   help="skip the check that the run directory is on a shared filesystem")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.slurm:
        return _slurm(args)
    return _torchrun(args)


def _torchrun(args: argparse.Namespace) -> int:
    from shardwise.cluster import job, torchrun

    if args.nnodes is None or args.rdzv_endpoint is None:
        raise UserError("shardwise launch needs --nnodes N and --rdzv-endpoint HOST:PORT (or "
                        "--slurm --nodes N to submit a Slurm job).")
    nproc = args.nproc_per_node or args.gpus_per_node or 1
    torchrun.check_counts(args.nnodes, nproc)
    endpoint = torchrun.Endpoint.parse(args.rdzv_endpoint)
    spec, run_dir = job.resolve(args.config, args.overrides, args.nnodes, local=endpoint.is_local,
                                assume_shared=args.assume_shared)
    # torchrun's options, run by shardwise.cluster.node: torchrun's agent, whose workers keep
    # their store on the rendezvous host and which says the store's loss in one paragraph
    command = torchrun.node_command(spec, run_dir, nnodes=args.nnodes, nproc_per_node=nproc,
                                    endpoint=endpoint, node_rank=args.node_rank,
                                    overrides=args.overrides, agent=torchrun.node_agent(run_dir))
    job.materialize(spec, run_dir)
    if not args.execute:
        print(torchrun.render(command))
        return 0
    print(f"run directory: {run_dir}\n{torchrun.render(command)}", file=sys.stderr, flush=True)
    return job.run_node(command, run_dir, spec.failure.preempt_signals)


def _slurm(args: argparse.Namespace) -> int:
    from shardwise.cluster import job, slurm, torchrun

    if args.nodes is None:
        raise UserError("shardwise launch --slurm needs --nodes N (and --gpus-per-node G on GPU "
                        "nodes).")
    if args.rdzv_endpoint or args.execute:
        raise UserError("--slurm chooses the rendezvous itself (the first node of the "
                        "allocation) and submits the job: leave out --rdzv-endpoint and --exec.")
    request = slurm.SlurmJob(
        nodes=args.nodes, nproc_per_node=args.nproc_per_node or args.gpus_per_node or 1,
        gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
        account=args.account, requeue=args.requeue, rdzv_port=args.rdzv_port)
    torchrun.check_counts(request.nodes, request.nproc_per_node)
    spec, run_dir = job.resolve(args.config, args.overrides, args.nodes, local=False,
                                assume_shared=args.assume_shared)
    job.check_slurm(spec, request, args.dry_run)
    prepared = job.materialize(spec, run_dir)
    script, job_id = job.submit_slurm(prepared, request, args.dry_run)
    if args.dry_run:
        print(f"wrote {script} (not submitted: --dry-run); submit it with `sbatch {script}`")
    else:
        print(f"submitted Slurm job {job_id}: {script}\nfollow it with `shardwise status "
              f"{run_dir}`")
    return 0
