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
from hetc.ir.spec import DeviceSpec
from hetc.ir.topology import Gpu
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

    from hetc import rank as rank_entry

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

    monkeypatch.setattr(rank_entry, "rendezvous_store", store)     # a rank's entry (hetc/rank.py) calls it
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


# ---------------------------------------------------------------- a step's timeout (Note [A timeout or a dead peer])


# A 2-stage pipeline of the demo job on two of its CPU ranks: the stalled rank's receive has a peer.
PIPELINE_OF_TWO = """use "{job}"

parallel {{
  schedule = 1f1b
  idle = [host[1]]
  stage first {{
    layers = embed..block1
    ranks = host[0, 0]
  }}
  stage second {{
    layers = block2..head
    ranks = host[0, 1]
  }}
}}
"""

# Loaded by every Python process whose path starts with its folder (sitecustomize): rank 1 sleeps in its
# first backward of step 1, alive (its heartbeat thread beats on) but sending nothing.
STALL_RANK_1 = """import os, time
if os.environ.get("RANK") == "1":
    from hetc.runtime.interpreter import Interpreter
    backward = Interpreter._backward
    def stalled(self, instr):
        if self.step_idx == 1:
            time.sleep(60)
        return backward(self, instr)
    Interpreter._backward = stalled
"""


@pytest.fixture(scope="module")
def pipeline_of_two(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pp2")
    spec = folder / "pp2.het"
    spec.write_text(PIPELINE_OF_TWO.format(job=DEMO / "job.het"))
    assert hetc_main(["compile", str(spec), "-o", str(folder / "plan")]) == 0
    return folder / "plan"


@pytest.mark.slow
def test_a_stalled_peer_is_a_timeout_in_one_paragraph(pipeline_of_two, tmp_path):
    """Rank 1 stalls mid-step; rank 0's receive waits out --timeout 3 and rank 0 says so: its step, the
    instruction, the receive it waits for and from whom, the timeout, what to do; it exits 1, no traceback.
    (The launcher exits with the status of the first rank it sees fail: rank 1's watchdog may end it, status
    3, before rank 0's process has finished exiting.)"""
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "sitecustomize.py").write_text(STALL_RANK_1)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    run = subprocess.run([sys.executable, "-m", "hetc", "run", str(pipeline_of_two), "--local", "--steps", "3", "-q",
                          "--timeout", "3", "--heartbeat-timeout", "2"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=path), timeout=180, check=False)
    assert run.returncode != 0 and "hetc run: rank 0 exited with status 1\n" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    line = next(x for x in run.stderr.splitlines() if "timed out" in x)
    assert line.startswith("hetc run: error: rank 0 timed out in step 1, instruction 10 `wait h=0`, waiting for "
                           "`recv grad ms=1 mb=0 from=1 shape=2x32x64 h=0` from rank 1: it did not complete within "
                           "--timeout 3 s (gloo: Timed out waiting 3000ms"), line
    assert "Rank 1 is alive (heartbeats go on): stalled or slower than the timeout allows, not dead" in line
    assert "raise --timeout" in line and "read rank 1's own message" in line
    assert "stopped responding (noticed by rank 0" not in run.stderr      # not taken for a dead peer


class _Heartbeats:
    """A watchdog's answer to `silent_ranks`, without a store."""

    def __init__(self, silent: list[int]) -> None:
        self.silent, self.declared = silent, []

    def silent_ranks(self) -> list[int]:
        return self.silent

    def declare_dead(self, rank: int) -> None:
        self.declared.append(rank)


def _failed_in(note: str) -> CommFailure:
    err = CommFailure("[/gloo/transport/tcp/pair.cc:589] Timed out waiting 120000ms for recv operation to complete")
    err.add_note(note)
    return err


def test_a_failed_call_is_a_dead_peer_when_one_stops_beating_and_a_timeout_when_none_does(pipeline_of_two):
    from hetc.plandir import read_program

    program = read_program(pipeline_of_two)
    err = _failed_in("[rank 0] step 4: instruction 10 `wait h=0`")
    dead = _Heartbeats([1])
    failure = worker._communication_failure(err, dead, 0, program, worker.RunOptions(), "gloo")
    assert isinstance(failure, worker.PeerFailure) and dead.declared == [1]
    assert str(failure).startswith("rank 1 stopped responding (noticed by rank 0: [rank 0] step 4: instruction 10")
    timeout = worker._communication_failure(err, _Heartbeats([]), 0, program, worker.RunOptions(), "nccl")
    assert isinstance(timeout, gpu_failures.CommTimeout)
    text = str(timeout)
    assert text.startswith("rank 0 timed out in step 4, instruction 10 `wait h=0`, waiting for `recv grad ms=1 mb=0 "
                           "from=1 shape=2x32x64 h=0` from rank 1: it did not complete within --timeout 120 s (nccl: "
                           "Timed out waiting 120000ms for recv operation to complete). Rank 1 is alive")
    assert "flight recorder" in text and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in text     # on NCCL only
    assert "pair.cc" not in text


def test_a_timed_out_collective_names_its_group_and_the_ranks_in_it(pipeline_of_two):
    from hetc.plandir import read_program

    program = read_program(pipeline_of_two)
    last = len(program.ranks[1].instrs) - 1      # the loss's all-reduce on the world group
    waited = gpu_failures.waited_for([f"[rank 1] step 0: instruction {last} `all_reduce loss group=world`"], 1,
                                     program.ranks[1].instrs, program.groups)
    assert waited is not None and waited.peers == (0,)
    text = gpu_failures.timeout_message(1, waited, 9, 300, "gloo", "Timed out")
    assert text.startswith(f"rank 1 timed out in step 0, instruction {last} `all_reduce loss group=world` on group "
                           "'world' (with rank 0): it did not complete within --timeout 9 s (gloo: Timed out). ")
    assert "flight recorder" not in text       # gloo keeps none


def test_a_timeout_outside_a_step_names_both_timeouts():
    text = gpu_failures.timeout_message(2, None, 120, 300, "gloo", "Timed out waiting 120000ms")
    assert text.startswith("rank 2 timed out outside a step (setting up or saving): it did not complete "
                           "within its timeout (--timeout 120 s; --init-timeout 300 s while the groups form)")
    assert "The other ranks are alive" in text and "read the messages of the other ranks" in text


def test_an_evaluation_note_is_not_taken_for_the_training_program(pipeline_of_two):
    """An evaluation numbers the instructions of its own program: the note's text differs, no op is guessed."""
    from hetc.plandir import read_program

    program = read_program(pipeline_of_two)
    waited = gpu_failures.waited_for(["[rank 0] step 2: instruction 3 `recv act ms=0 mb=0 from=7 shape=1 h=9`"], 0,
                                     program.ranks[0].instrs, program.groups)
    assert waited is not None and waited.op is None and waited.peers == ()
