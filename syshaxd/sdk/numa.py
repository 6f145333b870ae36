"""NUMA topology from sysfs, CPU worker placement plans, and applying a placement inside a worker process.

Three steps, kept apart so each can be tested on its own:

* ``read_topology(root)`` / ``read_host_topology()`` — which NUMA nodes exist,
  their CPUs and memory (from a sysfs tree; tests pass a fake one).
* ``plan_cpu_workers(topology, env, reserved=...)`` — pure planning: one decode
  worker per node by default, or the CPU sets of ``CUSTOM_CPU_AFFINITY``,
  threads from ``OMP_NUM_THREADS``, minus CPUs reserved for a prefill worker
  (``plan_prefill_worker``).
* ``apply_placement(placement)`` — run first thing in the spawned worker,
  before llama.cpp / OpenMP start: CPU affinity, ``OMP_NUM_THREADS`` and the
  ``set_mempolicy`` memory binding; returns what the kernel actually took.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SYSFS_NODE_ROOT = "/sys/devices/system/node"

ENV_CPU_AFFINITY = "CUSTOM_CPU_AFFINITY"
ENV_THREADS = "OMP_NUM_THREADS"

MEMPOLICIES = ("bind", "preferred", "none")

# <linux/mempolicy.h>
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4
MPOL_PREFERRED_MANY = 5
_MPOL_NAMES = {
    MPOL_DEFAULT: "default",
    MPOL_PREFERRED: "preferred",
    MPOL_BIND: "bind",
    MPOL_INTERLEAVE: "interleave",
    MPOL_LOCAL: "local",
    MPOL_PREFERRED_MANY: "preferred_many",
}

# glibc has no wrappers for these (libnuma does); (set_mempolicy, get_mempolicy).
# aarch64, riscv64 and loongarch64 share the generic syscall table.
_MEMPOLICY_SYSCALLS = {
    "x86_64": (238, 239),
    "amd64": (238, 239),
    "aarch64": (237, 236),
    "arm64": (237, 236),
    "riscv64": (237, 236),
    "loongarch64": (237, 236),
}

# Node masks we build and read back cover this many node ids (the kernel's
# MAX_NUMNODES is at most 1024); get_mempolicy refuses a smaller buffer than
# the kernel's node count.
_MASK_BITS = 1024
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


class PlacementError(ValueError):
    """A placement request (environment override or argument) that cannot be honoured."""


# --------------------------------------------------------------------------- cpulists


def parse_cpulist(text: str, *, what: str = "cpulist") -> frozenset[int]:
    """Parse a kernel cpulist (``0-39,80-119``, ``0-7:2`` strides) into a set of CPU ids; errors name ``what``."""
    try:
        return _parse_cpulist(text)
    except ValueError as exc:
        raise PlacementError(f"{what}={text!r}: {exc}") from None


def _parse_cpulist(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    stripped = text.strip()
    if not stripped:
        return frozenset()
    for part in stripped.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise ValueError(f"{part!r} is not a CPU number or range (expected a cpulist like '0-3,8-11')")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        stride = int(m.group(3)) if m.group(3) is not None else 1
        if last < first or stride < 1:
            raise ValueError(f"range {part!r} is empty or backwards")
        cpus.update(range(first, last + 1, stride))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as a compact kernel cpulist (``0-3,8-11``)."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


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


@dataclass(frozen=True)
class Placement:
    """Where one worker runs: CPUs to pin to, memory nodes to bind to, OpenMP threads.

    Picklable, so the daemon can hand it to a ``multiprocessing`` spawn child.
    """

    role: str  # "decode" or "prefill"
    index: int
    cpus: tuple[int, ...]
    mem_nodes: tuple[int, ...]
    threads: int
    mempolicy: str = "bind"  # "bind", "preferred" or "none"
    source: str = "numa"  # what decided the CPU set: "numa", CUSTOM_CPU_AFFINITY, "argument"

    @property
    def name(self) -> str:
        """A short worker name for logs: ``decode0``, ``prefill0``."""
        return f"{self.role}{self.index}"

    @property
    def cpulist(self) -> str:
        """The CPU set as a cpulist string."""
        return format_cpulist(self.cpus)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly view for logs, metrics and the admin socket."""
        return {
            "name": self.name,
            "role": self.role,
            "cpus": self.cpulist,
            "mem_nodes": list(self.mem_nodes),
            "threads": self.threads,
            "mempolicy": self.mempolicy,
            "source": self.source,
        }


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

    placements = []
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
            cpus = _parse_cpulist(chunk)
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


# --------------------------------------------------------------------------- applying


@dataclass(frozen=True)
class AppliedPlacement:
    """What the kernel took: the CPU affinity and memory policy read back after applying a placement."""

    cpus: tuple[int, ...]
    threads: int
    mempolicy: str  # as read back: "bind", "preferred", "default", ... or "unknown"
    mem_nodes: tuple[int, ...]
    warnings: tuple[str, ...] = field(default=())


def apply_placement(
    placement: Placement,
    environ: MutableMapping[str, str] | None = None,
) -> AppliedPlacement:
    """Pin the calling process to ``placement``: affinity, ``OMP_NUM_THREADS``, memory policy.

    Call it in the worker before importing llama.cpp / torch: OpenMP reads
    ``OMP_NUM_THREADS`` once, when its runtime starts, and pages already
    touched stay where they are. ``environ`` defaults to ``os.environ``. A
    memory policy the kernel or a container refuses (EPERM, ENOSYS) is logged
    and reported in ``warnings``; the worker still runs, just without binding.
    The memory policy is per thread and inherited by threads created later:
    call this from the worker's main thread before it starts any.
    """
    if environ is None:
        environ = os.environ
    warnings: list[str] = []

    os.sched_setaffinity(0, placement.cpus)
    environ[ENV_THREADS] = str(placement.threads)

    if placement.mempolicy != "none" and placement.mem_nodes:
        mode = MPOL_BIND if placement.mempolicy == "bind" else MPOL_PREFERRED
        try:
            set_mempolicy(mode, placement.mem_nodes)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOSYS):
                raise
            msg = (
                f"{placement.name}: set_mempolicy({placement.mempolicy}, nodes "
                f"{format_cpulist(placement.mem_nodes)}) refused ({errno.errorcode[exc.errno]}); "
                "memory stays unbound"
            )
            log.warning("%s", msg)
            warnings.append(msg)

    try:
        mode_now, nodes_now = get_mempolicy()
        policy_now = _MPOL_NAMES.get(mode_now, str(mode_now))
    except OSError as exc:
        policy_now, nodes_now = "unknown", ()
        if placement.mempolicy != "none":
            warnings.append(f"{placement.name}: get_mempolicy failed ({exc}); cannot confirm the memory policy")
    return AppliedPlacement(
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        threads=placement.threads,
        mempolicy=policy_now,
        mem_nodes=tuple(nodes_now),
        warnings=tuple(warnings),
    )


def set_mempolicy(mode: int, nodes: Iterable[int], *, machine: str | None = None) -> None:
    """Set the calling thread's NUMA memory policy (``MPOL_*``) over ``nodes``; raises OSError with the errno."""
    set_nr, _ = _syscall_numbers(machine)
    mask = _nodemask(nodes)
    # maxnode counts one past the highest bit: the kernel's historical off-by-one, as libnuma does.
    _syscall(set_nr, ctypes.c_int(mode), mask, ctypes.c_ulong(_MASK_BITS + 1))


def get_mempolicy(*, machine: str | None = None) -> tuple[int, tuple[int, ...]]:
    """The calling thread's memory policy: (``MPOL_*`` mode, node ids in its mask)."""
    _, get_nr = _syscall_numbers(machine)
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (_MASK_BITS // _ULONG_BITS))()
    _syscall(get_nr, ctypes.byref(mode), mask, ctypes.c_ulong(_MASK_BITS + 1), None, ctypes.c_ulong(0))
    nodes = tuple(
        word * _ULONG_BITS + bit
        for word, value in enumerate(mask)
        for bit in range(_ULONG_BITS)
        if value >> bit & 1
    )
    # Flags such as MPOL_F_STATIC_NODES live in the high bits of mode.
    return mode.value & 0xFFFF, nodes


def _nodemask(nodes: Iterable[int]) -> ctypes.Array[ctypes.c_ulong]:
    mask = (ctypes.c_ulong * (_MASK_BITS // _ULONG_BITS))()
    for node in nodes:
        if not 0 <= node < _MASK_BITS:
            raise PlacementError(f"NUMA node {node} out of range 0..{_MASK_BITS - 1}")
        mask[node // _ULONG_BITS] |= 1 << (node % _ULONG_BITS)
    return mask


def _syscall_numbers(machine: str | None) -> tuple[int, int]:
    arch = (machine or platform.machine()).lower()
    try:
        return _MEMPOLICY_SYSCALLS[arch]
    except KeyError:
        raise OSError(errno.ENOSYS, f"set_mempolicy syscall number unknown for {arch!r}") from None


def _syscall(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(number), *args)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result
