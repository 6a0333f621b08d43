"""Which TCP sockets a process tree listens on, read from /proc (Linux): what `ss -ltnp` shows."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


@dataclass(frozen=True)
class Listener:
    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)
        return self.address.is_loopback or bool(mapped and mapped.is_loopback)

    def __str__(self) -> str:
        return f"pid {self.pid} {self.address}:{self.port}"


def process_tree(root: int) -> set[int]:
    """`root` and every live descendant."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    return tree


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) that one of `pids` holds open."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    found = []
    for table, parse in (("/proc/net/tcp", _ipv4), ("/proc/net/tcp6", _ipv6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in owner:
                host, port = local.split(":")
                found.append(Listener(owner[inode], parse(host), int(port, 16)))
    return found


def _ipv4(text: str) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(bytes.fromhex(text)[::-1])  # one little-endian word


def _ipv6(text: str) -> ipaddress.IPv6Address:
    words = [bytes.fromhex(text[i:i + 8])[::-1] for i in range(0, 32, 8)]  # four of them
    return ipaddress.IPv6Address(b"".join(words))
