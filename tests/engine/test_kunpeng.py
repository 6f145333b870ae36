"""A 2-socket Kunpeng 920-6426 (128 ARM cores, 4 NUMA nodes of 32; tests/data/sysfs-kunpeng920-6426): the daemon's
own planning places its workers as it does on x86, and the llama.cpp plugin reads the ARM CPU's features from its
/proc/cpuinfo and chooses its kernels and attention from them.

The plan is the daemon's (engine/plan.plan_engines on the default model), with the host's topology read from the
fixture instead of this machine's /sys: the same functions, another machine's layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from syshax_llamacpp import kernels
from syshaxd.config import from_mapping
from syshaxd.engine import numa, plan
from syshaxd.sdk.types import Pool, Role

FIXTURE = Path(__file__).parents[1] / "data" / "sysfs-kunpeng920-6426"
NODES = FIXTURE / "devices" / "system" / "node"


@pytest.fixture
def kunpeng(monkeypatch):
    topology = numa.read_topology(NODES)
    monkeypatch.setattr(plan, "read_host_topology", lambda: topology)
    return topology


def _planned(cfg: dict, model: Path) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int, str]]:
    engines = plan.plan_engines(from_mapping(cfg), model, "m", {}, instance="kunpeng-test")
    return [(name, spec.placement.cpus, spec.placement.mem_nodes, spec.threads, spec.pool)
            for name, spec in engines.workers]


def span(first: int, last: int) -> tuple[int, ...]:
    return tuple(range(first, last + 1))


def test_the_fixture_reads_as_four_nodes_of_32_cores(kunpeng):
    assert [sorted(n.cpus) for n in kunpeng.nodes] == [list(span(32 * i, 32 * i + 31)) for i in range(4)]
    assert all(125 * 2**30 < n.mem_total < 127 * 2**30 for n in kunpeng.nodes)
    assert kunpeng.describe().splitlines()[2] == "node2: cpus 64-95 (32), 126.0 GiB"


def test_cpu_mode_runs_a_worker_per_node_bound_to_its_memory(kunpeng, default_model):
    assert _planned({"mode": "cpu", "prefix_cache_mb": 0}, default_model) == [
        (f"cpu{i}", span(32 * i, 32 * i + 31), (i,), 32, Pool.CPU) for i in range(4)]


def test_hetero_takes_a_quarter_of_the_first_node_for_prefill(kunpeng, default_model):
    workers = _planned({"mode": "hetero", "prefix_cache_mb": 0}, default_model)
    assert workers[0] == ("prefill0", span(0, 7), (0,), 8, Pool.PREFILL)
    assert workers[1:] == [("decode0", span(8, 31), (0,), 24, Pool.CPU)] + [
        (f"decode{i}", span(32 * i, 32 * i + 31), (i,), 32, Pool.CPU) for i in range(1, 4)]


def test_custom_affinity_sets_span_a_socket(kunpeng, default_model):
    """sysHAX's CUSTOM_CPU_AFFINITY: one worker per socket (two nodes each), bound to both of its nodes."""
    cfg = from_mapping({"mode": "cpu", "prefix_cache_mb": 0})
    engines = plan.plan_engines(cfg, default_model, "m", {"CUSTOM_CPU_AFFINITY": "0-63;64-127"}, instance="k")
    assert [(s.placement.cpus, s.placement.mem_nodes, s.threads, s.role) for _, s in engines.workers] == [
        (span(0, 63), (0, 1), 64, Role.GENERATE), (span(64, 127), (2, 3), 64, Role.GENERATE)]


def test_the_arm_features_choose_repacking_and_llama_cpps_own_attention():
    """Kunpeng 920 has NEON and dot product (asimddp), no AVX: llama.cpp's ARM repacking of q4_0 serves, and a
    decode step's tiled attention would pack K a scalar at a time, so the workers take llama.cpp's own attention
    (contexts.load_model says so in the log; the status names it in `exact.why`)."""
    flags = kernels.read_cpu_flags(str(FIXTURE / "proc-cpuinfo"), "aarch64")
    assert {"asimd", "asimddp", "fphp", "asimdhp"} <= flags and not any(f.startswith("avx") for f in flags)
    assert "sve" not in flags and "i8mm" not in flags
    assert not kernels.tiles_decode_cheaply(flags)
    choice = kernels.choose("auto", ["CPU_REPACK"], flags)
    assert (choice.use_extra_bufts, choice.kernels, choice.safe_repack) == (True, "repack", "off")
    assert kernels.choose("auto", ["CPU_REPACK", "CPU_KLEIDIAI"], flags).kernels == "repack+kleidiai"
