"""NUMA topology from sysfs and the CPU workers' placement plans: which NUMA nodes exist, and where each
worker goes. The daemon plans; each worker applies its Placement itself (syshaxd/sdk/placement.py).

Two steps, kept apart so each can be tested on its own:

* ``read_topology(root)`` / ``read_host_topology()`` — which NUMA nodes exist,
  their CPUs and memory (from a sysfs tree; tests pass a fake one).
* ``plan_cpu_workers(topology, env, reserved=...)`` — pure planning: one decode
  worker per node by default, or the CPU sets of ``CUSTOM_CPU_AFFINITY``,
  threads from ``OMP_NUM_THREADS``, minus CPUs reserved for a prefill worker
  (``plan_prefill_worker``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from syshaxd.sdk.placement import (
    ENV_THREADS,
    MEMPOLICIES,
    Placement,
    PlacementError,
    cpulist_cpus,
    format_cpulist,
    parse_cpulist,
)

log = logging.getLogger(__name__)

SYSFS_NODE_ROOT = "/sys/devices/system/node"
ENV_CPU_AFFINITY = "CUSTOM_CPU_AFFINITY"


# --------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, CPUs, and total memory in bytes (None when unknown)."""

    id: int
    cpus: frozenset[int]
    mem_total: int | None = None


@dataclass(frozen=True)
class Topology:
    """The host's NUMA nodes; ``numa`` is False for the single pseudo-node of a kernel without NUMA."""

    nodes: tuple[NumaNode, ...]
    numa: bool = True

    @property
    def cpus(self) -> frozenset[int]:
        """Every CPU on every node."""
        return frozenset().union(*(n.cpus for n in self.nodes)) if self.nodes else frozenset()

    def node_of(self, cpu: int) -> int | None:
        """The node id a CPU belongs to, or None."""
        for node in self.nodes:
            if cpu in node.cpus:
                return node.id
        return None

    def restricted(self, allowed_cpus: Iterable[int], allowed_mems: Iterable[int] | None = None) -> "Topology":
        """The same topology seen by a process limited to ``allowed_cpus`` (and, when given, ``allowed_mems``)."""
        allowed = frozenset(allowed_cpus)
        mems = None if allowed_mems is None else frozenset(allowed_mems)
        nodes = tuple(
            NumaNode(n.id, n.cpus & allowed, n.mem_total)
            for n in self.nodes
            if mems is None or n.id in mems
        )
        return Topology(nodes, self.numa)

    def describe(self) -> str:
        """One line per node, for logs and the admin socket."""
        lines = []
        for n in self.nodes:
            mem = f"{n.mem_total / 2**30:.1f} GiB" if n.mem_total else "memory unknown"
            lines.append(f"node{n.id}: cpus {format_cpulist(n.cpus) or '-'} ({len(n.cpus)}), {mem}")
        return "\n".join(lines)


def read_topology(root: str | os.PathLike[str] = SYSFS_NODE_ROOT) -> Topology:
    """Read NUMA nodes from a sysfs node directory (``nodeN/cpulist``, ``nodeN/meminfo``)."""
    base = Path(root)
    node_dirs = []
    for entry in base.iterdir():  # FileNotFoundError names the root: clear enough
        m = re.fullmatch(r"node(\d+)", entry.name)
        if m and entry.is_dir():
            node_dirs.append((int(m.group(1)), entry))
    if not node_dirs:
        raise FileNotFoundError(f"no nodeN directories under {base}")
    nodes = []
    for node_id, path in sorted(node_dirs):
        cpulist_file = path / "cpulist"
        cpus = parse_cpulist(cpulist_file.read_text(), what=str(cpulist_file))
        nodes.append(NumaNode(node_id, cpus, _read_mem_total(path / "meminfo")))
    return Topology(tuple(nodes), numa=True)


def read_host_topology(
    root: str | os.PathLike[str] = SYSFS_NODE_ROOT,
    *,
    proc_status: str | os.PathLike[str] = "/proc/self/status",
) -> Topology:
    """The topology this process may use: sysfs nodes limited to its allowed CPUs and memory nodes.

    A kernel without NUMA support has no node directory: that host is one
    pseudo-node (``numa=False``) holding the allowed CPUs, and placements on
    it set no memory policy.
    """
    allowed_cpus = frozenset(os.sched_getaffinity(0))
    try:
        topology = read_topology(root)
    except FileNotFoundError:
        log.info("no NUMA information under %s; treating the host as one node", root)
        return Topology((NumaNode(0, allowed_cpus, _read_mem_total("/proc/meminfo")),), numa=False)
    return topology.restricted(allowed_cpus, _read_mems_allowed(proc_status))


def _read_mem_total(meminfo: str | os.PathLike[str]) -> int | None:
    # "Node 0 MemTotal:       65536000 kB" (per node) or "MemTotal: ... kB" (/proc/meminfo)
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else None


def _read_mems_allowed(proc_status: str | os.PathLike[str]) -> frozenset[int] | None:
    # The cpuset's memory nodes; binding to a node outside it fails with EINVAL.
    try:
        text = Path(proc_status).read_text()
    except OSError:
        return None
    m = re.search(r"^Mems_allowed_list:\s*(\S*)\s*$", text, re.MULTILINE)
    return parse_cpulist(m.group(1), what="Mems_allowed_list") if m else None


# --------------------------------------------------------------------------- planning


def plan_cpu_workers(
    topology: Topology,
    env: Mapping[str, str] | None = None,
    *,
    reserved: Iterable[int] | str | None = None,
    mempolicy: str = "bind",
    role: str = "decode",
) -> list[Placement]:
    """Plan the CPU workers: one per NUMA node, or one per ``CUSTOM_CPU_AFFINITY`` set.

    ``env`` holds the overrides the caller read from its environment or
    config (``CUSTOM_CPU_AFFINITY``: a cpulist, or ``;``-separated cpulists,
    one per worker; ``OMP_NUM_THREADS``: threads per worker, default one per
    CPU). ``reserved`` CPUs (e.g. a prefill worker's) are taken out of every
    set. Raises ``PlacementError`` naming the variable and the bad value.
    """
    env = env or {}
    if mempolicy not in MEMPOLICIES:
        raise PlacementError(f"mempolicy={mempolicy!r}: expected one of {', '.join(MEMPOLICIES)}")
    reserved_cpus = _cpu_set(reserved, "reserved")
    available = topology.cpus
    stray = reserved_cpus - available
    if stray:
        raise PlacementError(
            f"reserved CPUs {format_cpulist(stray)} are not available to this process "
            f"(available: {format_cpulist(available) or 'none'})"
        )
    threads_override = _threads_from(env)

    affinity = (env.get(ENV_CPU_AFFINITY) or "").strip()
    if affinity:
        cpu_sets = _custom_cpu_sets(affinity, available)
        source = ENV_CPU_AFFINITY
    else:
        cpu_sets = [n.cpus for n in topology.nodes if n.cpus]
        source = "numa"
    if not cpu_sets:
        raise PlacementError("no CPUs available for CPU workers")

    placements: list[Placement] = []
    for cpus in cpu_sets:
        kept = cpus - reserved_cpus
        if not kept:
            if source == "numa":
                continue  # the whole node went to prefill: no decode worker there
            raise PlacementError(
                f"{ENV_CPU_AFFINITY}={affinity!r}: set {format_cpulist(cpus)} has no CPUs left "
                f"after reserving {format_cpulist(reserved_cpus)} for prefill"
            )
        placements.append(_placement(topology, role, len(placements), kept, threads_override, mempolicy, source))
    if not placements:
        raise PlacementError(
            f"no CPUs left for {role} workers after reserving {format_cpulist(reserved_cpus)} "
            f"(available: {format_cpulist(available)})"
        )
    return placements


def plan_prefill_worker(
    topology: Topology,
    cpus: Iterable[int] | str,
    *,
    threads: int | None = None,
    mempolicy: str = "bind",
) -> Placement:
    """Plan a CPU prefill worker on ``cpus``; pass the same ``cpus`` as ``reserved`` to ``plan_cpu_workers``."""
    if mempolicy not in MEMPOLICIES:
        raise PlacementError(f"mempolicy={mempolicy!r}: expected one of {', '.join(MEMPOLICIES)}")
    wanted = _cpu_set(cpus, "prefill cpus")
    if not wanted:
        raise PlacementError("prefill cpus: empty CPU set")
    stray = wanted - topology.cpus
    if stray:
        raise PlacementError(
            f"prefill cpus {format_cpulist(wanted)}: {format_cpulist(stray)} not available "
            f"(available: {format_cpulist(topology.cpus) or 'none'})"
        )
    if threads is not None and threads < 1:
        raise PlacementError(f"prefill threads={threads!r}: expected a positive integer")
    return _placement(topology, "prefill", 0, wanted, threads, mempolicy, "argument")


def _placement(
    topology: Topology,
    role: str,
    index: int,
    cpus: frozenset[int],
    threads: int | None,
    mempolicy: str,
    source: str,
) -> Placement:
    per_node: dict[int, int] = {}
    for cpu in cpus:
        node = topology.node_of(cpu)
        if node is not None:
            per_node[node] = per_node.get(node, 0) + 1
    if not topology.numa or not per_node:
        mem_nodes: tuple[int, ...] = ()
        mempolicy = "none"
    elif mempolicy == "preferred":
        # MPOL_PREFERRED takes one node: the one holding most of the worker's CPUs.
        mem_nodes = (max(sorted(per_node), key=lambda n: per_node[n]),)
    elif mempolicy == "bind":
        mem_nodes = tuple(sorted(per_node))
    else:
        mem_nodes = ()
    n_threads = threads if threads is not None else len(cpus)
    if n_threads > len(cpus):
        log.warning(
            "%s%d: %s=%d threads on %d CPUs (%s): oversubscribed",
            role, index, ENV_THREADS, n_threads, len(cpus), format_cpulist(cpus),
        )
    return Placement(role, index, tuple(sorted(cpus)), mem_nodes, n_threads, mempolicy, source)


def _cpu_set(value: Iterable[int] | str | None, what: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, str):
        return parse_cpulist(value, what=what)
    cpus = frozenset(value)
    bad = [c for c in cpus if not isinstance(c, int) or c < 0]
    if bad:
        raise PlacementError(f"{what}: {bad!r} are not CPU numbers")
    return cpus


def _threads_from(env: Mapping[str, str]) -> int | None:
    raw = env.get(ENV_THREADS)
    if raw is None or raw.strip() == "":
        return None
    try:
        threads = int(raw.strip())
    except ValueError:
        raise PlacementError(
            f"{ENV_THREADS}={raw!r}: expected one positive integer (OpenMP threads per CPU worker)"
        ) from None
    if threads < 1:
        raise PlacementError(f"{ENV_THREADS}={raw!r}: expected a positive integer (OpenMP threads per CPU worker)")
    return threads


def _custom_cpu_sets(affinity: str, available: frozenset[int]) -> list[frozenset[int]]:
    chunks = affinity.split(";")
    if len(chunks) > 1 and not chunks[-1].strip():
        chunks = chunks[:-1]  # tolerate one trailing ';'
    sets: list[frozenset[int]] = []
    for chunk in chunks:
        if not chunk.strip():
            raise PlacementError(f"{ENV_CPU_AFFINITY}={affinity!r}: empty CPU set between ';'")
        try:
            cpus = cpulist_cpus(chunk)
        except ValueError as exc:
            raise PlacementError(
                f"{ENV_CPU_AFFINITY}={affinity!r}: {exc}; several workers take ';'-separated cpulists"
            ) from None
        stray = cpus - available
        if stray:
            raise PlacementError(
                f"{ENV_CPU_AFFINITY}={affinity!r}: CPUs {format_cpulist(stray)} are not available "
                f"to this process (available: {format_cpulist(available) or 'none'})"
            )
        for earlier in sets:
            shared = earlier & cpus
            if shared:
                raise PlacementError(
                    f"{ENV_CPU_AFFINITY}={affinity!r}: CPUs {format_cpulist(shared)} appear in two worker sets"
                )
        sets.append(cpus)
    return sets
