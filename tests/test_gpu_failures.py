"""Clear GPU failures (issue 29: finding 8, What to build 6), checked on CPU where the logic is host-side.

Ranks that would share a GPU are refused by placement before any process group exists; a CUDA
out-of-memory is one paragraph with the rank, its stage, the instruction and the plan's estimate; init and
step timeouts are set apart, and NCCL's error handling is on. The out-of-memory and timeout cases run
`hetc run` in this process as the one torchrun rank of the 1-rank demo plan (as
tests/test_checkpoint_integrity.py does); the out-of-memory is injected by a handler that raises torch's.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetc.cli import main as hetc_main
from hetc.runtime import gpu_failures, worker
from hetc.runtime.gpu_failures import NCCL_DEFAULTS, nccl_environment, out_of_memory_in, out_of_memory_message
from hetc.runtime.interpreter import Interpreter
from hetc.runtime.local import free_port
from hetc.runtime.nn.collectives import CommFailure
from hetc.runtime.placement import ClusterMismatch, Process, local_gpu, place
from hetc.spec import DeviceSpec
from hetc.topology import Gpu
from tests.conftest import DEMO

H100 = DeviceSpec(name="H100", memory=80 * 2**30)


def _node(count: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(i, "gpu", 0, i, H100, "default", "default") for i in range(count))


def _procs(local_ranks: range, visible: int, uuid_of) -> list[Process]:
    """One process per local rank on host `n0`, each seeing `visible` devices and reporting `uuid_of(local)`."""
    return [Process(r, "n0", "n0/0", "", r, "NVIDIA H100 80GB HBM3", 79.2 * 2**30, uuid_of(r), visible)
            for r in local_ranks]


# ---------------------------------------------------------------- ranks that would share a GPU


def test_local_ranks_take_the_device_of_their_index_among_those_they_see():
    assert [local_gpu(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [local_gpu(r, 1) for r in range(4)] == [0, 0, 0, 0]     # CUDA_VISIBLE_DEVICES per process


def test_two_ranks_on_one_gpu_are_refused_with_the_ranks_the_node_and_the_device_count():
    """4 processes on a node that shows each of them 2 GPUs: local ranks 0 and 2 land on cuda:0, 1 and 3 on
    cuda:1. NCCL would fail in init_process_group ("Duplicate GPU detected"); placement says why first."""
    procs = _procs(range(4), 2, lambda local: f"GPU-{local_gpu(local, 2)}")
    with pytest.raises(ClusterMismatch) as caught:
        place(_node(4), procs)
    text = str(caught.value)
    assert "launch ranks 0, 2 (local ranks 0, 2 on n0) would share one GPU (NVIDIA H100 80GB HBM3 GPU-0)" in text
    assert "launch ranks 1, 3 (local ranks 1, 3 on n0) would share one GPU" in text
    assert "each sees 2 CUDA devices" in text and "torchrun --nproc-per-node 2" in text


def test_one_gpu_shown_to_each_process_is_not_shared():
    """A launcher that gives each process its own GPU (CUDA_VISIBLE_DEVICES per task): every process sees
    one device, cuda:0, and each is a different GPU."""
    placed = place(_node(4), _procs(range(4), 1, lambda local: f"GPU-{local}"))
    assert placed.plan_rank == {0: 0, 1: 1, 2: 2, 3: 3}


def test_gpus_of_the_same_index_on_two_hosts_are_not_shared():
    world = (*_node(1), Gpu(1, "gpu", 1, 0, H100, "default", "default"))
    procs = [Process(0, "n0", "n0/0", "", 0, "H100", 79.2 * 2**30, "GPU-0", 1),
             Process(1, "n1", "n1/0", "", 0, "H100", 79.2 * 2**30, "GPU-0", 1)]   # hosts differ
    assert place(world, procs).plan_rank == {0: 0, 1: 1}


def test_an_idle_process_of_an_elastic_run_may_share_a_gpu():
    procs = _procs(range(2), 1, lambda local: "GPU-0")
    assert place(_node(1), procs, elastic=True).idle == (1,)


# ---------------------------------------------------------------- the run in this process


@pytest.fixture(scope="module")
def single_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "single"
    assert hetc_main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    return out


@pytest.fixture
def as_rank0(monkeypatch):
    """This process as launch rank 0 of 1, as torchrun would start it; the process group is gone after."""
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "HETC_LOCAL_LAUNCHER", "HETC_NODE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():     # a run that stopped with an error leaves it (its process would exit)
        dist.destroy_process_group()


def _oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                 "of 79.19 GiB of which 1.02 GiB is free.\nmore lines of torch's advice")


def test_an_out_of_memory_in_a_step_is_one_paragraph(single_plan, as_rank0, monkeypatch, capsys):
    monkeypatch.setattr(Interpreter, "_forward", _oom)
    assert hetc_main(["run", str(single_plan), "-q", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "more lines" not in err
    line = next(x for x in err.splitlines() if "ran out of device memory" in x)
    assert line.startswith("hetc run: error: rank 0 (stage 0, lane 0, on cpu, planned as a cpu) ran out of "
                           "device memory during step 0: instruction ")
    assert "`fwd" in line and "Tried to allocate 2.00 GiB" in line
    assert "The plan's estimate for this rank was a peak of " in line and " at instruction " in line
    assert "train.micro_batch" in line and "activation_checkpoint" in line and "zero = 1, 2 or 3" in line


def test_an_out_of_memory_while_setting_up_is_one_paragraph(single_plan, as_rank0, monkeypatch, capsys):
    monkeypatch.setattr(worker, "build_rank", _oom)
    assert hetc_main(["run", str(single_plan), "-q", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "rank 0 (stage 0, lane 0, on cpu, planned as a cpu) ran out of device memory while setting up" in err


def test_an_out_of_memory_inside_a_communication_call_is_not_taken_for_a_dead_peer():
    """comm_call types every RuntimeError of a call as a CommFailure, chaining the cause."""
    oom = torch.OutOfMemoryError("CUDA out of memory")
    try:
        try:
            raise oom
        except RuntimeError as cause:
            raise CommFailure(str(cause)) from cause
    except CommFailure as err:
        assert out_of_memory_in(err) is oom
    assert out_of_memory_in(CommFailure("Connection closed by peer")) is None


def test_the_message_falls_back_to_the_device_when_there_is_no_estimate(single_plan, monkeypatch):
    from hetc.plandir import read_plan, read_program

    _, plan = read_plan(single_plan)
    program = read_program(single_plan)
    monkeypatch.setattr(gpu_failures, "_peak", _oom)
    assert gpu_failures.estimate_line(plan, program, 0).startswith("The plan's device has ")
    text = out_of_memory_message(0, 0, 0, "on cuda:0, planned as a H100", "", "CUDA out of memory", "E")
    assert text.startswith("rank 0 (stage 0, lane 0, on cuda:0, planned as a H100) ran out of device memory "
                           "while setting up (before the first step): CUDA out of memory. E. To fit")


# ---------------------------------------------------------------- timeouts and NCCL settings


def test_the_rendezvous_waits_the_init_timeout_and_steps_the_step_timeout(single_plan, as_rank0, monkeypatch):
    """Note [Init and step timeouts]: the store every process reports to waits --init-timeout; a CPU rank's
    gloo groups are created with --timeout (gloo keeps a group's first timeout for its messages), and
    every group has --timeout when the first step starts."""
    from torch.distributed.distributed_c10d import _world

    seen: dict[str, object] = {}
    real_store, real_init, real_step = worker.rendezvous_store, dist.init_process_group, gpu_failures.use_step_timeout

    def store(launch, timeout_s):
        seen["store"] = timeout_s
        return real_store(launch, timeout_s)

    def init(*args, **kwargs):
        seen["init"] = kwargs["timeout"]
        return real_init(*args, **kwargs)

    def step_timeout(timeout):
        seen["groups before"] = {_gloo_timeout(g) for g in _world.pg_map}
        real_step(timeout)
        seen["groups after"] = {_gloo_timeout(g) for g in _world.pg_map}

    monkeypatch.setattr(worker, "rendezvous_store", store)
    monkeypatch.setattr(worker.dist, "init_process_group", init)
    monkeypatch.setattr(worker, "use_step_timeout", step_timeout)
    assert hetc_main(["run", str(single_plan), "-q", "--steps", "1", "--timeout", "7", "--init-timeout", "11"]) == 0
    seven = datetime.timedelta(seconds=7)
    assert seen == {"store": 11.0, "init": seven, "groups before": {seven}, "groups after": {seven}}


def test_nccl_groups_are_created_with_the_init_timeout():
    init, step = datetime.timedelta(seconds=300), datetime.timedelta(seconds=120)
    assert gpu_failures.creation_timeout("nccl", init, step) == init
    assert gpu_failures.creation_timeout("gloo", init, step) == step


def _gloo_timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_timeouts_must_be_positive(single_plan, capsys):
    assert hetc_main(["run", str(single_plan), "--init-timeout", "0"]) == 2
    assert "--timeout and --init-timeout must be positive" in capsys.readouterr().err


def test_nccl_error_handling_is_set_unless_the_user_set_it(monkeypatch):
    for key in NCCL_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")     # the user's choice stays
    nccl_environment()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"


def test_every_field_of_a_report_travels_through_the_store():
    """Reports go through the store as JSON (`discover`): the GPU's identity and count come back."""
    import json

    proc = Process(3, "n0", "n0/0", "", 1, "H100", 1.0, "GPU-1", 2)
    assert Process(**json.loads(json.dumps(dataclasses.asdict(proc)))) == proc


def _waits_for_a_silent_peer(rank: int, port: int, out: Path) -> None:
    """Rank 0 receives from rank 1, which sends nothing, then all-reduces on a group created with the init
    timeout and set to the step timeout after; rank 1 stays silent, so both time out."""
    from hetc.runtime.gpu_failures import creation_timeout, use_step_timeout
    from hetc.runtime.nn import collectives

    init, step = datetime.timedelta(seconds=60), datetime.timedelta(seconds=1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=init)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=creation_timeout("gloo", init, step))
    later = dist.new_group([0, 1], timeout=init)
    use_step_timeout(step)
    if rank == 0:
        seen = []
        for call in (lambda: collectives.irecv(torch.zeros(4), 1, tag=0).wait(),
                     lambda: collectives.all_reduce(torch.zeros(4), group=later)):
            try:
                call()
                seen.append("no error")
            except CommFailure as err:
                seen.append(str(err))
        out.write_text("\n".join(seen))
    else:
        store.wait(["done"], datetime.timedelta(seconds=60))    # alive, silent, until rank 0 has its answer
    if rank == 0:
        store.set("done", "1")
    os._exit(0)


@pytest.mark.slow
def test_a_step_waits_the_step_timeout_not_the_init_timeout(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port, out = free_port(), tmp_path / "seen.txt"
    procs = [ctx.Process(target=_waits_for_a_silent_peer, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    lines = out.read_text().splitlines()                      # gloo names the timeout it waited
    assert len(lines) == 2 and all("Timed out waiting 1000ms" in line for line in lines)
