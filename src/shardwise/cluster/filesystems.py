"""Is a directory visible to other nodes? Read from the mount table, not assumed.

Every node of a job writes into the run directory (ledger shards, flight records, metrics from
rank 0, local checkpoints) and a restarted or requeued job must find them again, so a multi-node
run directory must be on a shared filesystem. A node-local one (tmpfs, a container's overlay, a
local disk) silently splits a run into per-node halves; this module detects it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UserError

#: filesystems whose contents other machines see (network and parallel filesystems)
SHARED = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs", "cifs", "smb3",
    "smbfs", "wekafs", "panfs", "pvfs2", "orangefs", "afs", "ocfs2", "gfs2", "9p", "virtiofs",
    "fuse.glusterfs", "fuse.ceph", "fuse.sshfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse",
    "fuse.weka", "fuse.lustre", "fuse.beegfs", "fuse.mount-s3", "fuse.rclone", "fuse.geesefs",
})
#: filesystems that are certainly this machine's own (memory, a container's layer)
NODE_LOCAL = frozenset({"tmpfs", "ramfs", "devtmpfs", "overlay", "overlayfs", "aufs", "squashfs"})


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str


def mount_of(path: Path, mountinfo: str | None = None) -> Mount | None:
    """The mount holding `path` (the longest mount point that contains it), from
    /proc/self/mountinfo; None where there is no such table (not Linux)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path.expanduser().absolute())  # symlinks of the existing part
    best: Mount | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, after[0], after[1] if len(after) > 1 else "")
    return best


def check_shared(run_dir: Path, nnodes: int, mountinfo: str | None = None) -> None:
    """Raise a UserError when a job of `nnodes` machines would write `run_dir` somewhere the
    other machines cannot see."""
    if nnodes <= 1:
        return
    mount = mount_of(run_dir, mountinfo)
    if mount is None or mount.fstype in SHARED:
        return
    kind = ("node-local memory or a container's own layer" if mount.fstype in NODE_LOCAL
            else "a filesystem of this machine only")
    raise UserError(
        f"run directory {run_dir} is on {mount.point} ({mount.fstype}: {kind}), which the "
        f"other {nnodes - 1} node{'s' if nnodes > 2 else ''} cannot see: their ledger, flight "
        "records and checkpoint shards would land on their own disks and a restart could not "
        "find them. Put the run on a shared filesystem (NFS, Lustre, GPFS, ...) with --set "
        "run.dir=/shared/path, and for checkpoints without one set checkpoint.uri = "
        "\"s3://BUCKET/PREFIX\"; pass --assume-shared if this mount is shared after all.")


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text
