"""Placement by discovery (runtime/placement.py): launched processes onto the plan's GPUs, no process group."""

from __future__ import annotations

import dataclasses

import pytest

from hetc.runtime.placement import ClusterMismatch, Process, place
from hetc.ir.spec import DeviceSpec
from hetc.ir.topology import Gpu

CPU = DeviceSpec(name="cpu", memory=4 * 2**30)
A100 = DeviceSpec(name="A100-80", memory=80 * 2**30)
A10 = DeviceSpec(name="A10", memory=24 * 2**30)


def _gpus(*nodes: tuple[str, int, DeviceSpec]) -> tuple[Gpu, ...]:
    """GPUs of nodes (group, count of GPUs, kind), node i of a group in order."""
    out, seen = [], {}
    for group, count, kind in nodes:
        node = seen[group] = seen.get(group, -1) + 1
        out += [Gpu(len(out) + i, group, node, i, kind, "default", "default") for i in range(count)]
    for i, gpu in enumerate(out):
        out[i] = dataclasses.replace(gpu, id=i)
    return tuple(out)


def _procs(*agents: tuple[str, int, str, float], label: dict | None = None) -> list[Process]:
    """Processes of agents (name, process count, device, memory GiB), launch ranks in this order."""
    out = []
    for agent, count, device, mem in agents:
        for local in range(count):
            out.append(Process(len(out), "host-" + agent, agent, (label or {}).get(agent, ""), local, device,
                               mem * 2**30))
    return out


def test_nodes_are_matched_by_size_whatever_the_launch_order():
    world = _gpus(("big", 2, CPU), ("small", 1, CPU))
    small_first = place(world, _procs(("s", 1, "cpu", 0), ("b", 2, "cpu", 0)))
    assert small_first.plan_rank == {0: 2, 1: 0, 2: 1}
    big_first = place(world, _procs(("b", 2, "cpu", 0), ("s", 1, "cpu", 0)))
    assert big_first.plan_rank == {0: 0, 1: 1, 2: 2}


def test_devices_decide_between_nodes_of_one_size():
    world = _gpus(("fast", 2, A100), ("slow", 2, A10))
    placed = place(world, _procs(("x", 2, "NVIDIA A10", 23.6), ("y", 2, "NVIDIA A100-SXM4-80GB", 79.3)))
    assert placed.plan_rank == {2: 0, 3: 1, 0: 2, 1: 3}


def test_the_smallest_device_that_fits_is_taken_so_every_node_finds_one():
    world = _gpus(("small_mem", 1, A10), ("big_mem", 1, A100))
    # the 80 GiB device also fits the A10 node: taking it first would leave the A100 node without one
    placed = place(world, _procs(("x", 1, "NVIDIA A100", 79.3), ("y", 1, "NVIDIA A10", 23.6)))
    assert placed.plan_rank == {0: 1, 1: 0}


def test_a_label_from_hetc_launch_decides():
    world = _gpus(("a", 1, CPU), ("a", 1, CPU))
    placed = place(world, _procs(("x", 1, "cpu", 0), ("y", 1, "cpu", 0), label={"x": "a[1]", "y": "a[0]"}))
    assert placed.plan_rank == {0: 1, 1: 0}


def test_a_process_beyond_the_plan_is_named():
    world = _gpus(("big", 2, CPU), ("small", 1, CPU))
    with pytest.raises(ClusterMismatch, match=r"launch rank 3 \(host-c, local rank 1, cpu\) matches no GPU"):
        place(world, _procs(("b", 2, "cpu", 0), ("c", 2, "cpu", 0)))


def test_a_plan_node_without_processes_is_named():
    world = _gpus(("big", 2, CPU), ("small", 1, CPU))
    with pytest.raises(ClusterMismatch, match=r"no launched node fits the plan's node small\[0\] \(1 × cpu\): "
                                              "no launched node is left for it"):
        place(world, _procs(("b", 2, "cpu", 0)))


def test_a_process_without_the_plans_gpu_is_an_error():
    with pytest.raises(ClusterMismatch, match=r"host-x \(1 processes\) launch rank 0 .* has no GPU, but the plan "
                                              r"wants a A100-80"):
        place(_gpus(("g", 1, A100)), _procs(("x", 1, "cpu", 0)))


def test_elastic_runs_let_processes_idle():
    placed = place(_gpus(("big", 2, CPU)), _procs(("s", 1, "cpu", 0), ("b", 2, "cpu", 0)), elastic=True)
    assert placed.plan_rank == {1: 0, 2: 1} and placed.idle == (0,)


def test_in_an_elastic_run_a_named_node_the_plan_leaves_out_idles():
    procs = _procs(("x", 1, "cpu", 0), ("y", 2, "cpu", 0), label={"x": "small[0]", "y": "big[0]"})
    placed = place(_gpus(("big", 2, CPU)), procs, elastic=True)
    assert placed.plan_rank == {1: 0, 2: 1} and placed.idle == (0,)
    with pytest.raises(ClusterMismatch, match="launched as node small\\[0\\], which the plan does not use"):
        place(_gpus(("big", 2, CPU)), procs)
