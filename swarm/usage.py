"""What a process tree holds (a peer daemon with its DHT process and their p2pd): resident memory, open files and
threads, summed; what a peer reports of itself and what the memory soak samples."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil


@dataclass(frozen=True)
class Usage:
    rss: int  # resident bytes
    fds: int  # open file descriptors
    threads: int
    parts: dict[str, int] = field(default_factory=dict, compare=False)  # resident bytes: root, p2pd, other children


def tree_usage(root: int, leave_out: Iterable[int] = ()) -> Usage:
    """``root`` and its descendants, without the subtrees of ``leave_out`` (a client's tree without the local swarm
    it started). A process that ends while it is looked at counts nothing."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return Usage(0, 0, 0)
    skipped: set[int] = set()
    for pid in leave_out:
        try:
            skipped |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            skipped.add(pid)
    fds = threads = 0
    parts: dict[str, int] = {}
    for proc in procs:
        if proc.pid in skipped:
            continue
        try:
            with proc.oneshot():
                kind = "root" if proc.pid == root else "p2pd" if proc.name() == "p2pd" else "children"
                parts[kind] = parts.get(kind, 0) + proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return Usage(sum(parts.values()), fds, threads, parts)
