"""Failures are recognised by type: communication failures (Note [communication failures] in
runtime/nn/collectives.py), and the interpreter's located re-raise of any exception."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetc.ir.program import Forward, RankProgram, Wait, parse_instr
from hetc.runtime.interpreter import Interpreter, ProtocolError
from hetc.runtime.nn import collectives
from hetc.runtime.nn.collectives import CommFailure, comm_call, is_comm_failure
from hetc.runtime.placement import ClusterMismatch


def _raising(err: BaseException) -> Callable[..., None]:
    def call(*_: object) -> None:
        raise err
    return call


def test_an_untyped_runtime_error_of_a_call_becomes_a_comm_failure():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:25485")
    with pytest.raises(CommFailure) as caught:
        comm_call(_raising(gloo))()
    assert caught.value.__cause__ is gloo and str(caught.value) == str(gloo)


@pytest.mark.parametrize("typed", [dist.DistBackendError("nccl"), dist.DistNetworkError("store"),
                                   dist.DistStoreError("store")], ids=lambda e: type(e).__name__)
def test_torchs_typed_failures_pass_unchanged_and_count(typed):
    with pytest.raises(type(typed)) as caught:
        comm_call(_raising(typed))()
    assert caught.value is typed and is_comm_failure(typed)


def test_other_errors_pass_unchanged_and_do_not_count():
    with pytest.raises(ValueError):
        comm_call(_raising(ValueError("bad shape")))()
    # the text of a message no longer decides
    assert not is_comm_failure(RuntimeError("gloo: Connection reset by peer; Timed out"))
    assert not is_comm_failure(ClusterMismatch("no such node"))
    assert is_comm_failure(CommFailure("Timed out"))


def _survivor(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(0)                 # the peer dies without a word
    seen = []
    for name, call in (("all_reduce", lambda: collectives.all_reduce(t)),
                       ("irecv wait", lambda: collectives.irecv(t, 1, tag=0).wait())):
        try:
            call()
            seen.append(f"{name}: no error")
        except Exception as err:  # noqa: BLE001 - recorded for the test to judge
            seen.append(f"{name}: {type(err).__name__}")
    out.write_text("\n".join(seen))
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_dead_gloo_peer_is_a_comm_failure(tmp_path):
    """What torch 2.13's gloo raises here is a bare RuntimeError; the runtime's calls type it."""
    ctx = multiprocessing.get_context("spawn")
    port, out = _free_port(), tmp_path / "seen.txt"
    procs = [ctx.Process(target=_survivor, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert out.read_text().splitlines() == ["all_reduce: CommFailure", "irecv wait: CommFailure"]


class _Odd(Exception):
    """An exception whose constructor takes more than a message (what `type(err)(message)` broke on)."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(f"code {code} at {where}")
        self.code = code


def _interpreter(instrs: str, handlers: dict[type, Callable[[Interpreter], Callable[..., None]]]) -> Interpreter:
    interp = Interpreter.__new__(Interpreter)   # the step loop alone: no model, no process group
    interp.program = RankProgram(0, 0, 0, 0, 0, (), tuple(parse_instr(i) for i in instrs.splitlines()))
    interp.device = torch.device("cpu")
    interp.world = 1
    interp._begin = lambda step: setattr(interp, "pending", {})
    interp._handlers = {kind: handler(interp) for kind, handler in handlers.items()}
    return interp


def test_the_interpreter_reraises_the_same_exception_with_its_location():
    odd = _Odd(7, "here")
    interp = _interpreter("fwd ms=0 mb=0", {Forward: lambda _: _raising(odd)})
    with pytest.raises(_Odd) as caught:
        interp.run_step(3)
    assert caught.value is odd and caught.value.code == 7
    assert caught.value.__notes__ == ["[rank 0] step 3: instruction 0 `fwd ms=0 mb=0`"]


def test_a_protocol_error_names_the_instruction():
    interp = _interpreter("wait h=5", {Wait: lambda self: self._wait})
    with pytest.raises(ProtocolError, match="handle 5 is not in flight") as caught:
        interp.run_step(1)
    assert caught.value.__notes__ == ["[rank 0] step 1: instruction 0 `wait h=5`"]
