"""Which group a collective runs on: its name, its size, and the mesh axis a run calls it.

Torch accepts a group in several forms (a ProcessGroup, None for the default group, a
(DeviceMesh, dim) pair as DTensor passes it, a 1-D DeviceMesh, a group name as the functional
collectives pass it); the tap counts calls by the group's name, mapped to a mesh axis ("dp_shard",
"tp", "pp", "dp", "world") through `axes_of`. Name lookups are on every call's path: a
(mesh, dim) pair's name is cached.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardwise.compat import resolve_process_group


def _resolve(group: Any) -> dist.ProcessGroup | None:
    """A process group from any of the forms torch accepts; None is the default group."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        return mesh.get_group(dim)
    if isinstance(group, str):
        return resolve_process_group(group)
    get_group = getattr(group, "get_group", None)  # a 1-D DeviceMesh
    if get_group is not None:
        return get_group()
    return None


def _group_name(group: Any) -> str:
    if isinstance(group, str):  # functional collectives name their group
        return group
    if isinstance(group, tuple) and len(group) == 2:  # (mesh, dim): DTensor's form, hot in TP
        key = (id(group[0]), group[1])
        cached = _MESH_GROUPS.get(key)
        if cached is None or cached[0] is not group[0]:
            cached = _MESH_GROUPS[key] = (group[0], _resolve(group).group_name)
        return cached[1]
    try:
        pg = _resolve(group)
        if pg is None:
            return "world" if not dist.is_initialized() else dist.group.WORLD.group_name
        return pg.group_name
    except Exception:  # an exotic form (a rank list): still count the call
        return "other"


#: (id(mesh), dim) -> (mesh, group name); holding the mesh keeps its id from being reused
_MESH_GROUPS: dict[tuple[int, Any], tuple[Any, str]] = {}


def _group_size(group: Any) -> int:
    try:
        pg = _resolve(group)
        return dist.get_world_size(pg)
    except Exception:
        return 1


def axes_of(mesh: Any, dp_mesh: Any) -> dict[str, str]:
    """Process-group name -> mesh axis name, for the named mesh of a run (None: one process)."""
    axes: dict[str, str] = {}
    if dist.is_initialized():
        axes[dist.group.WORLD.group_name] = "world"
    if dp_mesh is not None and dp_mesh.size() > 1:
        axes[dp_mesh.get_group().group_name] = "dp"
    for name in (mesh.mesh_dim_names or ()) if mesh is not None else ():
        group = mesh.get_group(name)
        if group.size() > 1:  # a real axis names its group, even when it spans the world
            axes[group.group_name] = name
        else:
            axes.setdefault(group.group_name, name)
    return axes
