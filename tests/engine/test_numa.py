"""Tests for syshaxd.engine.numa (planning, on a fake Kunpeng 920 sysfs tree) and syshaxd.sdk.placement
(applying, on this host's real /sys)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
from pathlib import Path

import pytest

from syshaxd.engine import numa
from syshaxd.engine.numa import NumaNode, Topology
from syshaxd.sdk import placement as applying
from syshaxd.sdk.placement import PlacementError

KUNPENG = Path(__file__).parents[1] / "data" / "sysfs-kunpeng920" / "devices" / "system" / "node"


@pytest.fixture
def kunpeng() -> Topology:
    return numa.read_topology(KUNPENG)


def span(first: int, last: int) -> tuple[int, ...]:
    return tuple(range(first, last + 1))


# ---------------------------------------------------------------- reading sysfs


def test_reads_the_kunpeng_920_layout(kunpeng):
    assert [n.id for n in kunpeng.nodes] == [0, 1, 2, 3]
    assert [sorted(n.cpus) for n in kunpeng.nodes] == [list(span(40 * i, 40 * i + 39)) for i in range(4)]
    assert kunpeng.cpus == frozenset(range(160))
    assert kunpeng.nodes[0].mem_total == 132_095_152 * 1024
    assert kunpeng.nodes[3].mem_total == 133_953_944 * 1024
    assert kunpeng.node_of(85) == 2
    assert kunpeng.describe().splitlines()[1] == "node1: cpus 40-79 (40), 127.7 GiB"


def test_cpulist_parsing_and_formatting():
    assert applying.parse_cpulist("0-39,80-119\n") == frozenset([*range(40), *range(80, 120)])
    assert applying.parse_cpulist("0-7:2") == frozenset({0, 2, 4, 6})
    assert applying.parse_cpulist("\n") == frozenset()
    assert applying.format_cpulist({0, 1, 2, 3, 8, 9, 10, 11, 20}) == "0-3,8-11,20"
    with pytest.raises(PlacementError, match=r"node0/cpulist='0-a'"):
        applying.parse_cpulist("0-a", what="node0/cpulist")


def test_a_missing_sysfs_root_is_an_error_but_the_host_falls_back_to_one_node(tmp_path):
    with pytest.raises(FileNotFoundError):
        numa.read_topology(tmp_path / "absent")
    host = numa.read_host_topology(tmp_path / "absent")
    assert not host.numa and len(host.nodes) == 1
    assert host.cpus == frozenset(os.sched_getaffinity(0))
    (placement,) = numa.plan_cpu_workers(host, {})
    assert placement.mempolicy == "none" and placement.mem_nodes == ()


def test_allowed_cpus_and_mems_restrict_the_plan(kunpeng):
    # e.g. a cgroup cpuset of 0-9,40-49 and mems 0-1, or CPUAffinity= in the unit
    limited = kunpeng.restricted([*range(10), *range(40, 50)], allowed_mems=[0, 1])
    plan = numa.plan_cpu_workers(limited, {})
    assert [(p.cpus, p.mem_nodes, p.threads) for p in plan] == [(span(0, 9), (0,), 10), (span(40, 49), (1,), 10)]


# ---------------------------------------------------------------- planning


def test_default_plan_is_one_decode_worker_per_node(kunpeng):
    plan = numa.plan_cpu_workers(kunpeng, {})
    assert len(plan) == 4
    for i, p in enumerate(plan):
        assert p.name == f"decode{i}"
        assert p.cpus == span(40 * i, 40 * i + 39)
        assert p.mem_nodes == (i,)
        assert p.threads == 40
        assert p.mempolicy == "bind"
        assert p.source == "numa"
    assert plan[2].to_dict() == {
        "name": "decode2", "role": "decode", "cpus": "80-119", "mem_nodes": [2],
        "threads": 40, "mempolicy": "bind", "source": "numa",
    }
    assert pickle.loads(pickle.dumps(plan)) == plan  # crosses a spawn boundary


def test_omp_num_threads_sets_threads_per_worker(kunpeng):
    plan = numa.plan_cpu_workers(kunpeng, {"OMP_NUM_THREADS": "32"})
    assert [p.threads for p in plan] == [32] * 4
    assert [p.cpus for p in plan][1] == span(40, 79)


def test_custom_cpu_affinity_single_set(kunpeng):
    (p,) = numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "0-3,8-11"})
    assert p.cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert p.threads == 8
    assert p.mem_nodes == (0,)
    assert p.source == "CUSTOM_CPU_AFFINITY"


def test_custom_cpu_affinity_several_sets_with_threads(kunpeng):
    env = {"CUSTOM_CPU_AFFINITY": "0-19; 40-59;80-99;", "OMP_NUM_THREADS": "16"}
    plan = numa.plan_cpu_workers(kunpeng, env)
    assert [(p.cpulist, p.mem_nodes, p.threads) for p in plan] == [
        ("0-19", (0,), 16), ("40-59", (1,), 16), ("80-99", (2,), 16),
    ]


def test_a_set_spanning_nodes_binds_to_both_or_prefers_the_majority(kunpeng):
    (bound,) = numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "36-47"})
    assert bound.mem_nodes == (0, 1)
    (preferred,) = numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "36-47"}, mempolicy="preferred")
    assert preferred.mem_nodes == (1,) and preferred.mempolicy == "preferred"


def test_empty_values_mean_unset(kunpeng):
    assert numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "  ", "OMP_NUM_THREADS": ""}) == \
        numa.plan_cpu_workers(kunpeng, {})


def test_reserved_prefill_cpus_leave_the_decode_sets(kunpeng):
    prefill = numa.plan_prefill_worker(kunpeng, "0-7")
    assert (prefill.name, prefill.cpus, prefill.threads, prefill.mem_nodes) == ("prefill0", span(0, 7), 8, (0,))
    plan = numa.plan_cpu_workers(kunpeng, {}, reserved=prefill.cpus)
    assert [(p.cpulist, p.threads) for p in plan] == [("8-39", 32), ("40-79", 40), ("80-119", 40), ("120-159", 40)]


def test_reserving_a_whole_node_drops_its_decode_worker(kunpeng):
    plan = numa.plan_cpu_workers(kunpeng, {}, reserved="0-39")
    assert [(p.name, p.cpulist, p.mem_nodes) for p in plan] == [
        ("decode0", "40-79", (1,)), ("decode1", "80-119", (2,)), ("decode2", "120-159", (3,)),
    ]


def test_reserved_cpus_also_leave_custom_sets(kunpeng):
    plan = numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "0-7;8-15"}, reserved="0-3")
    assert [p.cpulist for p in plan] == ["4-7", "8-15"]
    with pytest.raises(PlacementError, match=r"CUSTOM_CPU_AFFINITY='0-3;8-15'.*0-3 has no CPUs left"):
        numa.plan_cpu_workers(kunpeng, {"CUSTOM_CPU_AFFINITY": "0-3;8-15"}, reserved="0-3")


def test_hetero_on_a_two_core_machine():
    two_cores = Topology((NumaNode(0, frozenset({0, 1}), 8 * 2**30),))
    prefill = numa.plan_prefill_worker(two_cores, [0])
    (decode,) = numa.plan_cpu_workers(two_cores, {}, reserved=prefill.cpus)
    assert (prefill.cpus, prefill.threads) == ((0,), 1)
    assert (decode.cpus, decode.threads, decode.mem_nodes) == ((1,), 1, (0,))
    with pytest.raises(PlacementError, match="no CPUs left for decode workers"):
        numa.plan_cpu_workers(two_cores, {}, reserved="0-1")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OMP_NUM_THREADS": "many"}, r"OMP_NUM_THREADS='many': expected one positive integer"),
        ({"OMP_NUM_THREADS": "0"}, r"OMP_NUM_THREADS='0': expected a positive integer"),
        ({"OMP_NUM_THREADS": "-4"}, r"OMP_NUM_THREADS='-4': expected a positive integer"),
        ({"OMP_NUM_THREADS": "4,2"}, r"OMP_NUM_THREADS='4,2': expected one positive integer"),
        ({"CUSTOM_CPU_AFFINITY": "0-3,x"}, r"CUSTOM_CPU_AFFINITY='0-3,x': 'x' is not a CPU number or range"),
        ({"CUSTOM_CPU_AFFINITY": "0-3 8-11"}, r"CUSTOM_CPU_AFFINITY='0-3 8-11': '0-3 8-11' is not a CPU"),
        ({"CUSTOM_CPU_AFFINITY": "9-3"}, r"CUSTOM_CPU_AFFINITY='9-3': range '9-3' is empty or backwards"),
        ({"CUSTOM_CPU_AFFINITY": "0-3;;8-11"}, r"CUSTOM_CPU_AFFINITY='0-3;;8-11': empty CPU set"),
        ({"CUSTOM_CPU_AFFINITY": "150-170"}, r"CUSTOM_CPU_AFFINITY='150-170': CPUs 160-170 are not available"),
        ({"CUSTOM_CPU_AFFINITY": "0-7;4-11"}, r"CUSTOM_CPU_AFFINITY='0-7;4-11': CPUs 4-7 appear in two"),
    ],
)
def test_bad_values_name_the_variable_and_the_value(kunpeng, env, message):
    with pytest.raises(PlacementError, match=message):
        numa.plan_cpu_workers(kunpeng, env)


def test_bad_arguments_are_refused(kunpeng):
    with pytest.raises(PlacementError, match=r"reserved CPUs 500 are not available"):
        numa.plan_cpu_workers(kunpeng, {}, reserved=[500])
    with pytest.raises(PlacementError, match=r"mempolicy='interleave'"):
        numa.plan_cpu_workers(kunpeng, {}, mempolicy="interleave")
    with pytest.raises(PlacementError, match=r"prefill cpus 158-161: 160-161 not available"):
        numa.plan_prefill_worker(kunpeng, "158-161")


# ---------------------------------------------------------------- applying, on this host


def _apply_in_child(placement: applying.Placement) -> dict:
    """Runs in a spawned child: apply, then read the result back from the kernel independently."""
    before = applying.get_mempolicy()
    applied = applying.apply_placement(placement)
    bytearray(8 << 20)  # touch fresh memory under the new policy
    status = Path("/proc/self/status").read_text()
    numa_maps = Path("/proc/self/numa_maps").read_text()
    return {
        "before": before,
        "applied": applied,
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpus_allowed_list": re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M).group(1),
        "mempolicy": applying.get_mempolicy(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        # numa_maps shows each mapping's effective policy (the task's, unless the mapping has its own)
        "map_policies": {line.split()[1] for line in numa_maps.splitlines()},
    }


def test_apply_placement_in_a_spawned_worker_on_this_host():
    host = numa.read_host_topology()
    assert host.nodes, "no CPUs visible"
    cpus = sorted(host.cpus)
    if len(cpus) >= 2:
        # hetero on a small box: prefill keeps the first CPU, decode gets the rest
        prefill = numa.plan_prefill_worker(host, cpus[:1])
        placement = numa.plan_cpu_workers(host, {}, reserved=prefill.cpus)[0]
        assert cpus[0] not in placement.cpus
    else:
        placement = numa.plan_cpu_workers(host, {})[0]

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        seen = pool.apply(_apply_in_child, (placement,))

    assert seen["affinity"] == list(placement.cpus)
    assert applying.parse_cpulist(seen["cpus_allowed_list"]) == frozenset(placement.cpus)
    assert seen["omp"] == str(placement.threads)
    assert seen["applied"].cpus == placement.cpus
    assert sorted(os.sched_getaffinity(0)) == cpus  # the daemon itself stays unpinned

    if placement.mempolicy == "none":
        pytest.skip("this kernel has no NUMA: no memory policy to check")
    if seen["applied"].warnings:
        pytest.skip(f"memory policy refused on this host: {seen['applied'].warnings[0]}")
    assert seen["before"][0] == applying.MPOL_DEFAULT
    assert seen["mempolicy"] == (applying.MPOL_BIND, placement.mem_nodes)
    assert (seen["applied"].mempolicy, seen["applied"].mem_nodes) == ("bind", placement.mem_nodes)
    nodes = ",".join(str(n) for n in placement.mem_nodes)
    assert seen["map_policies"] == {f"bind:{nodes}"}


def test_unknown_architecture_is_enosys():
    with pytest.raises(OSError) as info:
        applying.set_mempolicy(applying.MPOL_BIND, [0], machine="vax")
    assert info.value.errno == applying.errno.ENOSYS
