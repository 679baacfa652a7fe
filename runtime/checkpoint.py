"""Distributed checkpoints with torch.distributed.checkpoint (DCP), resharded on load.

Note [Checkpoint layout]
A checkpoint is plan-free: every tensor is keyed by global parameter name
and stored flattened (1-D, the parameter's numel), whatever plan wrote it.

    model.<fqn>                      fp32 master weights of parameter <fqn>
    optimizer.state.<fqn>.<state>    its optimizer state (exp_avg, exp_avg_sq, momentum_buffer)
    train.step                       optimizer steps done = the next step to run

Beside DCP's files rank 0 writes model.het, the model block the weights
belong to (explicit: every field written, no hf directory), and, for a
model read from a Hugging Face directory, its config.json as hf_config.json:
what `hetc export hf` needs to name and shape the tensors (runtime/hf_export.py).

The data source is stateless ((step, microbatch) -> tokens) and the
learning rate a function of the step, so the step is all the trainer state.
On save each rank writes the pieces of its `unique_range` (replicas of a
shard split it; MinistageBuffers.unique_range), as chunks at their offset in
the flattened parameter (runtime/pieces.py); DCP's save planner rejects a
plan whose chunks overlap or leave a hole, so "every element written
exactly once" is checked on every save. On load each rank asks for what the
*new* plan gives it: the optimizer state of its optimizer shard (a slice),
and the parameters of its `param_range` (its inner shard at ZeRO-3, else
its ministages whole), from which the master, the compute buffer, the
ZeRO-3 shard or the host copy are filled locally (no gather); a rank that
resumes built no values of its own (Note [Ranks that load their weights]
in runtime/buffers.py), so it holds its share and no more. DCP's load planner reads the overlap of each request with whatever
chunks the old plan wrote: that is the resharding. Tensor-parallel slices
are chunks of the full parameters (runtime/pieces.py), so a TP=2 checkpoint
loads into a TP=1 plan and back.

Note [Atomic saves]
All ranks write into DIR/step-N.tmp; once DCP has written the metadata
(the last act of a save, after every rank's data), rank 0 renames the
directory to DIR/step-N and then replaces DIR/latest (a one-line file
naming it) with os.replace. A save that fails or is killed half-way leaves
at most a stale *.tmp, which the next save removes: `latest` only ever
names a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from hetc.runtime.nn import collectives
from hetc.frontend.printer import format_spec
from hetc.runtime.pieces import FlatPieces, PieceLoadPlanner, PieceSavePlanner, layout_pieces
from hetc.runtime.unit_buffers import Buffers
from hetc.spec import Spec

__all__ = [
    "HF_CONFIG_FILE",
    "LATEST",
    "MODEL_FILE",
    "STEP_KEY",
    "CheckpointError",
    "Checkpointer",
    "complete_steps",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "read_params",
    "save_checkpoint",
]

log = logging.getLogger("hetc.runtime")

LATEST = "latest"
MODEL_FILE = "model.het"
HF_CONFIG_FILE = "hf_config.json"
STEP_KEY = "train.step"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer.state."


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read: missing, incomplete or of another model."""


class Checkpointer:
    """Saves of one run into DIR/step-N, asynchronous where asked; see Notes [Atomic saves], [Async saves].

    `keep` (None: all) is how many complete checkpoints stay; older ones are
    removed only once a newer one is published, so the last complete one
    survives every interrupted save.
    """

    def __init__(self, rt, directory: Path, keep: int | None = None, group=None, asynchronous: bool = False):
        self.rt, self.directory, self.keep = rt, Path(directory), keep
        self.group = group if group is not None else rt.interpreter.comm.group("world")
        self.asynchronous = asynchronous
        self.leader = dist.get_rank(self.group) == 0
        self._pending: tuple[int, Path, Future] | None = None

    def save(self, step: int) -> None:
        """Start saving the state after `step` optimizer steps (collective); `wait` completes it."""
        self.wait()
        final = self.directory / f"step-{step}"
        tmp = final.with_name(final.name + ".tmp")
        if self.leader:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        collectives.barrier(group=self.group)
        state = _save_state(self.rt.buffers, step)
        writer = dcp.FileSystemWriter(tmp)
        future: Future
        if self.asynchronous:
            response = dcp.async_save(state, storage_writer=writer, planner=PieceSavePlanner(),
                                      process_group=self.group, async_stager=_HostStager())
            # a stager that copies before returning gets a plain Future (no staging future)
            future = response if isinstance(response, Future) else response.upload_completion
        else:
            future = Future()
            try:
                future.set_result(dcp.save(state, storage_writer=writer, planner=PieceSavePlanner(),
                                           process_group=self.group))
            except dcp.CheckpointException as err:
                future.set_exception(err)
        self._pending = (step, tmp, future)

    def poll(self) -> None:
        """Publish the save in flight if it is done (called after every step; costs nothing otherwise)."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> Path | None:
        """Complete the save in flight, if any: DIR/latest names it once this returns on the leader."""
        if self._pending is None:
            return None
        step, tmp, future = self._pending
        self._pending = None
        try:
            future.result()
        except dcp.CheckpointException as err:
            raise CheckpointError(f"saving step {step} into {tmp} failed: {_cause(err)}; "
                                  f"{self.directory / LATEST} still names the last complete checkpoint") from None
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        if self.leader:
            _write_model(self.rt.interpreter.spec.model, tmp)
            _publish(self.directory, tmp, final)
            if self.keep is not None:
                _prune(self.directory, self.keep)
            log.info("checkpoint of step %d: %s", step, final)
        return final


def save_checkpoint(rt, directory: Path, step: int) -> Path:
    """Save rank runtime `rt` after `step` optimizer steps into DIR/step-N; collective over the plan.

    Returns once DIR/latest names the new checkpoint on every rank."""
    saver = Checkpointer(rt, directory)
    saver.save(step)
    final = saver.wait()
    collectives.barrier(group=saver.group)
    assert final is not None
    return final


def load_checkpoint(rt, directory: Path) -> int:
    """Load the latest checkpoint in `directory` into `rt`; return the next step (0 when there is none)."""
    path = latest_checkpoint(directory)
    if path is None:
        log.warning("no checkpoint in %s yet: starting at step 0", directory)
        return 0
    step = read_checkpoint(rt.buffers, path, rt.interpreter.comm.group("world"))
    log.info("resumed from %s at step %d", path, step)
    return step


def read_checkpoint(buffers: dict[int, Buffers], path: Path, group) -> int:
    """Fill `buffers` from checkpoint `path` (a step-N directory), each rank its own share (collective over
    `group`, the plan's ranks); return the next step."""
    state, kept = _load_state(buffers)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=PieceLoadPlanner(), process_group=group)
    except dcp.CheckpointException as err:
        raise CheckpointError(f"cannot load {path}: {_cause(err)}") from None
    for ms, buf in buffers.items():
        for i, part in enumerate(buf.parts()):
            part.load_params(kept[(ms, i)], part.param_range)
    step = state[STEP_KEY]
    if not isinstance(step, int):
        raise CheckpointError(f"cannot load {path}: its {STEP_KEY} is {step!r}, not a step number")
    return step


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint DIR/latest names, or None when nothing was saved yet."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def read_params(path: Path) -> dict[str, Tensor]:
    """The fp32 parameters of checkpoint `path` (a step-N directory), flattened, by name; no process group."""
    reader = dcp.FileSystemReader(path)
    sizes = {k: md.size for k, md in reader.read_metadata().state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}   # parameters: tensors
    state = {k: torch.empty(size, dtype=torch.float32) for k, size in sizes.items()}
    with warnings.catch_warnings():     # one process on purpose: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k.removeprefix(MODEL_PREFIX): t for k, t in state.items()}


# ---------------------------------------------------------------- state dicts


def _save_state(buffers: dict[int, Buffers], step: int) -> dict[str, object]:
    """The pieces this rank writes: its `unique_range` of the master and of the optimizer state."""
    state: dict[str, object] = {STEP_KEY: step}
    for buf in (part for whole in buffers.values() for part in whole.parts()):
        rng, base = buf.unique_range, buf.opt_range.start
        local = slice(rng.start - base, rng.stop - base)
        named = {"": buf.master, **{f".{n}": t for n, t in buf.opt_state.tensors().items()}}
        for suffix, tensor in named.items():
            for name, pieces in layout_pieces(buf.layout, rng, tensor[local], buf.infos).items():
                if buf.infos[name].dim is None and not buf.writes_replicated:
                    continue          # a tp replica: tp rank 0 writes it
                key = f"{MODEL_PREFIX}{name}" if not suffix else f"{OPTIM_PREFIX}{name}{suffix}"
                state[key] = pieces
    return state


def _load_state(buffers: dict[int, Buffers]) -> tuple[dict[str, object], dict[tuple, Tensor]]:
    """What this rank reads: the parameters of its `param_range` (its inner shard at ZeRO-3, else its
    ministages whole; into fresh fp32 buffers of that range, by (ms, part)) and its optimizer-state slices."""
    state: dict[str, object] = {STEP_KEY: 0}
    kept = {}
    for ms, whole in buffers.items():
        for i, buf in enumerate(whole.parts()):
            rng = buf.param_range
            kept[(ms, i)] = values = torch.zeros(rng.stop - rng.start, dtype=torch.float32,
                                                 device=buf.master.device)
            for name, pieces in layout_pieces(buf.layout, rng, values, buf.infos).items():
                state[f"{MODEL_PREFIX}{name}"] = pieces
            for n, tensor in buf.opt_state.tensors().items():
                for name, pieces in layout_pieces(buf.layout, buf.opt_range, tensor, buf.infos).items():
                    state[f"{OPTIM_PREFIX}{name}.{n}"] = pieces
    return state, kept


class _HostStager(AsyncStager):
    """Copies this rank's pieces to host memory before the background write (training goes on
    changing the originals); DCP's default stager does not know FlatPieces."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, object]) -> dict[str, object]:
        return {k: _to_host(v) for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        return None      # `stage` copies before it returns

    def close(self) -> None:
        return None


def _to_host(value: object) -> object:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, FlatPieces):
        return FlatPieces(value.numel, tuple((off, view.detach().to("cpu", copy=True))
                                             for off, view in value.chunks))
    return value


# ---------------------------------------------------------------- files


def _publish(directory: Path, tmp: Path, final: Path) -> None:
    """Make `tmp` the checkpoint `final` and point DIR/latest at it; see Note [Atomic saves]."""
    old = final.with_name(final.name + ".old")
    if final.exists():        # saving a step again after resuming from an earlier one
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    pointer = directory / (LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, directory / LATEST)
    _fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)


def complete_steps(directory: Path) -> list[int]:
    """The steps of the complete checkpoints in `directory` (their metadata written), oldest first."""
    steps = []
    for path in Path(directory).glob("step-*"):
        number = path.name.removeprefix("step-")
        if number.isdigit() and (path / ".metadata").is_file():
            steps.append(int(number))
    return sorted(steps)


def _prune(directory: Path, keep: int) -> None:
    """Remove complete checkpoints but the newest `keep` (and never the one `latest` names)."""
    latest = (directory / LATEST).read_text().strip()
    for step in complete_steps(directory)[:-keep]:
        if f"step-{step}" != latest:
            shutil.rmtree(directory / f"step-{step}", ignore_errors=True)


def _write_model(model, directory: Path) -> None:
    """model.het (and hf_config.json) beside the tensors; see Note [Checkpoint layout]."""
    if model.hf and (model.hf_dir() / "config.json").is_file():
        shutil.copyfile(model.hf_dir() / "config.json", directory / HF_CONFIG_FILE)
    explicit = dataclasses.replace(model, hf="", init=None)
    (directory / MODEL_FILE).write_text(format_spec(Spec(model=explicit)))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cause(err: dcp.CheckpointException) -> str:
    """The first rank's error, in one line (DCP gathers every rank's traceback)."""
    for rank, (exc, _) in sorted(err.failures.items()):
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        return f"(rank {rank}) {text[:300]}"
    return str(err).splitlines()[0]
