"""Where a worker runs, and putting it there: the Placement the daemon plans (syshaxd/engine/numa.py) and
hands to each worker, and applying it first thing in the worker process.

``apply_placement(placement)`` runs in the spawned worker before llama.cpp / OpenMP start: CPU affinity,
``OMP_NUM_THREADS`` and the ``set_mempolicy`` memory binding; it returns what the kernel actually took.
The cpulist helpers are here too, since a Placement prints its CPU set as one.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

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
        return cpulist_cpus(text)
    except ValueError as exc:
        raise PlacementError(f"{what}={text!r}: {exc}") from None


def cpulist_cpus(text: str) -> frozenset[int]:
    """parse_cpulist without the naming: a bad cpulist raises ValueError saying what is wrong with it."""
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

# --------------------------------------------------------------------------- the placement


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
