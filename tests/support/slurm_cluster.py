"""A real single-node Slurm cluster on 127.0.0.1 for the tests: munged, slurmctld and slurmd from
the Debian packages (`apt-get install slurm-wlm munge`), every file in one temporary directory,
every daemon stopped at the end.

The configuration that runs in a container without systemd or a writable cgroup tree:
proctrack/linuxproc (process tracking through /proc, no cgroups), task/none, no accounting
(accounting_storage/none, jobacct_gather/none), SlurmUser = SlurmdUser = root, and munge on a
socket of its own (AuthInfo=socket=...). SLURM_CONF points every Slurm command at it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel",
           "scontrol", "sinfo")


def missing() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def slurm_conf(root: Path, node: str, cpus: int, ports: list[int], munge_socket: Path) -> str:
    return "\n".join([
        "ClusterName=shardwise-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "MpiDefault=none",
        "KillWait=30",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "MinJobAge=300",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    node: str = field(default_factory=socket.gethostname)
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, timeout_s: float = 60) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for name in ("state", "spool", "munge"):
            (self.root / name).mkdir(exist_ok=True)
        munge_dir = self.root / "munge"
        munge_dir.chmod(0o700)
        key = munge_dir / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True,
                       capture_output=True)
        sock = munge_dir / "munge.socket"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}",
                     f"--socket={sock}", f"--pid-file={munge_dir}/munged.pid",
                     f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/seed"])
        self._wait(lambda: sock.exists(), timeout_s, "munged socket")
        conf = self.root / "slurm.conf"
        cpus = os.cpu_count() or 2
        conf.write_text(slurm_conf(self.root, self.node, cpus, _free_ports(2), sock))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        os.environ["SLURM_CONF"] = str(conf)  # in-process `shardwise launch --slurm` calls
        self._spawn(["slurmctld", "-D", "-i", "-f", str(conf)])
        self._spawn(["slurmd", "-D", "-N", self.node, "-f", str(conf)])
        self._wait(self._node_idle, timeout_s, "the node to be idle in sinfo")

    def _spawn(self, argv: list[str]) -> None:
        log = (self.root / f"{Path(argv[0]).name}.stdout").open("ab")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env or None, start_new_session=True))

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        return out.returncode == 0 and out.stdout.strip().startswith("idle")

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"exited: {', '.join(dead)}" if dead else "timed out"
                raise RuntimeError(f"Slurm test cluster: no {what} ({why}); logs in "
                                   f"{self.root}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env,
                              check=check, timeout=60)

    def job_state(self, job_id: str) -> str:
        """squeue's state, or scontrol's after the job left the queue (no accounting here)."""
        out = self.run("scontrol", "show", "job", job_id, check=False)
        for item in out.stdout.split():
            if item.startswith("JobState="):
                return item.split("=", 1)[1]
        return "UNKNOWN"

    def wait_for(self, job_id: str, states: set[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        state = self.job_state(job_id)
        while state not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout_s} s\n"
                                     f"{self.logs()}")
            time.sleep(0.3)
            state = self.job_state(job_id)
        return state

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd, slurmctld, munged) it started."""
        if self.env:
            self.run("scancel", "--full", "--user", "root", check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if os.environ.get("SLURM_CONF") == self.env.get("SLURM_CONF"):
            os.environ.pop("SLURM_CONF", None)
