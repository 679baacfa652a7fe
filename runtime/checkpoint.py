"""Distributed checkpoints with torch.distributed.checkpoint (DCP), resharded on load.

Note [Checkpoint layout]
A checkpoint is plan-free: every tensor is keyed by global parameter name
and stored flattened (1-D, the parameter's numel), whatever plan wrote it.

    model.<fqn>                      fp32 master weights of parameter <fqn>
    optimizer.state.<fqn>.<state>    its optimizer state (exp_avg, exp_avg_sq, momentum_buffer)
    train.step                       steps done = the next step to run
    train.updates                    optimizer updates applied: the steps done less the skipped ones
    train.loss_scale                 fp16: the loss scaler's (scale, good steps, hysteresis left)

Beside DCP's files rank 0 writes model.het, the model block the weights
belong to (explicit: every field written, no hf directory), and, for a
model read from a Hugging Face directory, its config.json as hf_config.json:
what `hetc export hf` needs to name and shape the tensors (runtime/hf_export.py),
with its tokenizer files and generation_config.json (Note [A complete export]);
data.json, the data the run trained on (Note [What a checkpoint is of] in
runtime/checkpoint_identity.py, which a resume compares); and, last,
checksums.json over every other file (Note [Checkpoint checksums] in
runtime/checkpoint_files.py).

The data source is stateless ((step, microbatch) -> tokens) and the
learning rate a function of the updates applied (Note [skipped updates] in
runtime/optim.py), so the step and the update count are all the trainer
state but fp16's loss scale (Note [dynamic loss scale] in
runtime/loss_scale.py), saved beside them; a checkpoint without one (of
another dtype) resumes at the spec's initial scale, one without an update
count at its step.
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
(after every rank's data), rank 0 writes model.het, data.json and then the
checksums of every file, renames the directory to DIR/step-N and then
replaces DIR/latest (a one-line file naming it) with os.replace. A save
that fails or is killed half-way leaves at most a stale *.tmp (a failed
one is removed at once, giving back the space of a full disk), which the
next save removes: `latest` only ever names a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from hetc.runtime.checkpoint_identity import write_data_identity
from hetc.runtime.checkpoint_files import (LATEST, CheckpointError, complete_steps, has_checkpoint, verify_manifest,
                                           write_manifest)
from hetc.runtime.nn import collectives
from hetc.runtime.loss_scale import LossScaler
from hetc.frontend.printer import format_spec
from hetc.runtime.pieces import FlatPieces, PieceLoadPlanner, PieceSavePlanner, layout_pieces
from hetc.runtime.unit_buffers import Buffers
from hetc.ir.spec import Spec

__all__ = [
    "HF_CONFIG_FILE",
    "LATEST",
    "MODEL_FILE",
    "STEP_KEY",
    "UPDATES_KEY",
    "CheckpointError",
    "Checkpointer",
    "NonFiniteState",
    "ResumePoint",
    "Resumed",
    "complete_steps",
    "find_resumable",
    "has_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "read_params",
    "restore",
    "save_checkpoint",
]

log = logging.getLogger("hetc.runtime")

MODEL_FILE = "model.het"
HF_CONFIG_FILE = "hf_config.json"
STEP_KEY = "train.step"
UPDATES_KEY = "train.updates"
LOSS_SCALE_KEY = "train.loss_scale"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optimizer.state."


class NonFiniteState(CheckpointError):
    """A save refused: the state holds a NaN or an infinity (Note [finite saves])."""


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
        state[UPDATES_KEY] = self.rt.interpreter.updates
        if (scaler := self.rt.interpreter.scaler) is not None:
            state[LOSS_SCALE_KEY] = scaler.state()
        if not _finite_everywhere(state, self.group):
            raise NonFiniteState(f"step {step}'s weights or optimizer state are not finite: not saved, so that "
                                 f"{self.directory / LATEST} keeps naming a usable checkpoint")
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
        if self.leader:     # model.het, data.json, checksums.json: in the background writer's thread, if any
            future = _then(future, lambda: _describe(self.rt.interpreter, tmp))
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
            raise _save_failed(step, tmp, _cause(err), self.leader) from None
        except OSError as err:      # the leader's files beside DCP's
            raise _save_failed(step, tmp, f"{type(err).__name__}: {err}", self.leader) from None
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        if self.leader:
            _publish(self.directory, tmp, final)
            if self.keep is not None:
                _prune(self.directory, self.keep)
            print(f"saved step {step} to {final}", flush=True)   # once: the leader, after `latest` names it
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
    """Load the checkpoint `find_resumable` picks in `directory` into `rt` (every rank picks it itself);
    return the next step (0 when there is none)."""
    path = find_resumable(directory).path
    if path is None:
        log.warning("no checkpoint in %s yet: starting at step 0", directory)
        return 0
    step = restore(rt, path)
    log.info("resumed from %s at step %d", path, step)
    return step


def restore(rt, path: Path, weights_only: bool = False) -> int:
    """Load checkpoint `path` into rank runtime `rt` (collective over its plan): the weights, the optimizer
    state, the update count and fp16's loss scale, or the weights alone; the next step (0 for weights_only)."""
    interpreter = rt.interpreter
    resumed = read_checkpoint(rt.buffers, path, interpreter.comm.group("world"), weights_only, interpreter.scaler)
    interpreter.updates = resumed.updates
    return resumed.step


@dataclass(frozen=True)
class Resumed:
    """Where a checkpoint's run stood."""

    step: int       # steps done: the next step to run
    updates: int    # optimizer updates applied (Note [skipped updates] in runtime/optim.py)


def read_checkpoint(buffers: dict[int, Buffers], path: Path, group, weights_only: bool = False,
                    scaler: LossScaler | None = None) -> Resumed:
    """Fill `buffers` (and fp16's `scaler`, where the checkpoint has its state) from checkpoint `path` (a
    step-N directory), each rank its own share (collective over `group`, the plan's ranks); return where its
    run stood. `weights_only`: the parameters alone (the optimizer state and the scale stay as built, fresh),
    and the run starts over, at step 0. The caller checked the files (`verify_manifest`)."""
    state, kept = _load_state(buffers)
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    if weights_only:
        state = {k: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    else:
        if scaler is not None and LOSS_SCALE_KEY in saved:
            state[LOSS_SCALE_KEY] = scaler.state()
        if UPDATES_KEY in saved:
            state[UPDATES_KEY] = 0
    try:
        dcp.load(state, storage_reader=reader, planner=PieceLoadPlanner(), process_group=group)
    except dcp.CheckpointException as err:
        raise CheckpointError(f"cannot load {path}: {_cause(err)}") from None
    if scaler is not None and LOSS_SCALE_KEY in state:
        scaler.restore(_loss_scale_state(state[LOSS_SCALE_KEY], path))
    for ms, buf in buffers.items():
        for i, part in enumerate(buf.parts()):
            part.load_params(kept[(ms, i)], part.param_range)
    step = _count(state, STEP_KEY, 0, path)
    return Resumed(step, _count(state, UPDATES_KEY, step, path))   # no count: written before hetc kept one


def _count(state: dict[str, object], key: str, default: int, path: Path) -> int:
    """The count `state` holds at `key`, or a CheckpointError naming what it holds."""
    value = state.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CheckpointError(f"cannot load {path}: its {key} is {value!r}, not a count of steps")


def _loss_scale_state(value: object, path: Path) -> tuple[float, int, int]:
    """The loss scaler's state as a checkpoint holds it, or a CheckpointError naming what it holds."""
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value) \
            and value[0] > 0:
        return float(value[0]), int(value[1]), int(value[2])
    raise CheckpointError(f"cannot load {path}: its {LOSS_SCALE_KEY} is {value!r}, not a loss scaler's state")


# Note [Which checkpoint --resume loads]
# The one DIR/latest names, if it is complete and its files match their checksums (Note [Checkpoint
# checksums]); otherwise the newest complete step-N that does, with a message naming what was passed over
# and why: `latest` deleted, naming a missing or incomplete folder, or a corrupt file. `latest` comes first
# because it is what the run published last (a step-N beside it may be one whose publishing was cut short).
# A directory with neither `latest` nor a complete step-N holds nothing to resume: `--resume` refuses it,
# `--resume-if-present` (and --elastic) starts at step 0. One that holds checkpoints but no intact one is an
# error either way: starting afresh would overwrite them.
@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to resume from (None: the directory holds none) and what was passed over to find it."""

    path: Path | None
    passed_over: tuple[str, ...] = ()


def find_resumable(directory: Path) -> ResumePoint:
    """The checkpoint in `directory` that --resume loads; see Note [Which checkpoint --resume loads]."""
    directory = Path(directory)
    passed: list[str] = []
    named = _named_by_latest(directory, passed)
    newest_first = [directory / f"step-{s}" for s in reversed(complete_steps(directory))]
    candidates = ([named] if named is not None else []) + [p for p in newest_first if p != named]
    for path in candidates:
        try:
            verify_manifest(path)
        except CheckpointError as err:
            passed.append(f"skipped {path.name} ({_located(err)})")
            continue
        return ResumePoint(path, tuple(passed))
    if has_checkpoint(directory):
        raise CheckpointError(f"{directory} holds no intact checkpoint to resume from: passed over "
                              f"{'; '.join(passed)}", directory / LATEST if not newest_first else None)
    return ResumePoint(None)


def _named_by_latest(directory: Path, passed: list[str]) -> Path | None:
    """The checkpoint DIR/latest names if it is complete; else None, with the reason in `passed`."""
    if not (directory / LATEST).is_file():
        if complete_steps(directory):
            passed.append(f"{directory / LATEST} is missing")
        return None
    try:
        return latest_checkpoint(directory)
    except CheckpointError as err:
        passed.append(str(err))
        return None


def _located(err: CheckpointError) -> str:
    return f"{err.path}: {err}" if err.path is not None else str(err)


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
    """The fp32 parameters of checkpoint `path` (a step-N directory), flattened, by name; no process group.

    The files are checked against their checksums first (Note [Checkpoint checksums])."""
    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"'{path}' is not a complete checkpoint (a step-N folder of `hetc run --checkpoint "
                              "DIR`)")
    verify_manifest(Path(path))
    reader = dcp.FileSystemReader(path)
    try:
        sizes = {k: md.size for k, md in reader.read_metadata().state_dict_metadata.items()
                 if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)}   # parameters: tensors
        state = {k: torch.empty(size, dtype=torch.float32) for k, size in sizes.items()}
        with warnings.catch_warnings():     # one process on purpose: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except dcp.CheckpointException as err:
        raise CheckpointError(f"cannot read {path}: {_cause(err)}") from None
    return {k.removeprefix(MODEL_PREFIX): t for k, t in state.items()}


# ---------------------------------------------------------------- state dicts


def _save_state(buffers: dict[int, Buffers], step: int) -> dict[str, object]:
    """The pieces this rank writes: its `unique_range` of the master and of the optimizer state."""
    state: dict[str, object] = {STEP_KEY: step}
    for buf in (part for whole in buffers.values() for part in whole.parts()):
        rng, base = buf.unique_range, buf.opt_range.start
        local = slice(rng.start - base, rng.stop - base)
        named = {"": buf.master_values(), **{f".{n}": t for n, t in buf.opt_state.tensors().items()}}
        for suffix, tensor in named.items():
            for name, pieces in layout_pieces(buf.layout, rng, tensor[local], buf.infos).items():
                if buf.infos[name].dim is None and not buf.writes_replicated or name == buf.tied_copy:
                    continue          # a tp replica: tp rank 0 writes it; a tied copy: the embedding's holder
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
                                                 device=buf.state_device)
            for name, pieces in layout_pieces(buf.layout, rng, values, buf.infos).items():
                state[f"{MODEL_PREFIX}{buf.stored_name(name)}"] = pieces
            for n, tensor in buf.opt_state.tensors().items():
                for name, pieces in layout_pieces(buf.layout, buf.opt_range, tensor, buf.infos).items():
                    state[f"{OPTIM_PREFIX}{buf.stored_name(name)}.{n}"] = pieces
    return state, kept


# Note [finite saves]
# A checkpoint is for resuming, and weights with a NaN or an infinity cannot be resumed from; a save that
# would hold any is refused on every rank (one all-reduce of a flag over the saver's group, before DCP
# writes), so neither `latest` nor retention ever trades a finite checkpoint for a poisoned one. The run
# normally stops before such a save (Note [non-finite steps] in runtime/worker.py); this is the rule the
# directory keeps whatever the caller.
def _finite_everywhere(state: dict[str, object], group) -> bool:
    """Whether every rank's pieces of `state` are finite (collective over `group`)."""
    mine = all(bool(torch.isfinite(t).all()) for t in _tensors(state))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _tensors(state: dict[str, object]) -> Iterator[Tensor]:
    for value in state.values():
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, FlatPieces):
            yield from (view for _, view in value.chunks)


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


def _prune(directory: Path, keep: int) -> None:
    """Remove complete checkpoints but the newest `keep` (and never the one `latest` names)."""
    latest = (directory / LATEST).read_text().strip()
    for step in complete_steps(directory)[:-keep]:
        if f"step-{step}" != latest:
            shutil.rmtree(directory / f"step-{step}", ignore_errors=True)


def _write_model(model, directory: Path) -> None:
    """model.het (and hf_config.json, the tokenizer files) beside the tensors; see Note [Checkpoint layout]."""
    from hetc.runtime.hf_export import copy_hf_files

    if model.hf and (model.hf_dir() / "config.json").is_file():
        shutil.copyfile(model.hf_dir() / "config.json", directory / HF_CONFIG_FILE)
        copy_hf_files(model.hf_dir(), directory)    # Note [A complete export] in runtime/hf_export.py
    explicit = dataclasses.replace(model, hf="", init=None)
    (directory / MODEL_FILE).write_text(format_spec(Spec(model=explicit)))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _then(future: Future, finish: Callable[[], None]) -> Future:
    """A future done once `future` succeeded and then `finish` ran, in the thread that completed `future`
    (an async save's writer: off the training loop), or failed with the first error."""
    done: Future = Future()

    def chain(first: Future) -> None:
        try:
            first.result()
            finish()
        except BaseException as err:  # noqa: BLE001 - handed over to whoever waits on `done`
            done.set_exception(err)
        else:
            done.set_result(None)

    future.add_done_callback(chain)
    return done


def _describe(interpreter, tmp: Path) -> None:
    """What the checkpoint is of (the interpreter's model and train blocks), then the checksums of every
    file: the last writes before publishing (Notes [What a checkpoint is of], [Checkpoint checksums])."""
    _write_model(interpreter.model, tmp)
    write_data_identity(interpreter.model, interpreter.train, tmp)
    write_manifest(tmp)


def _save_failed(step: int, tmp: Path, cause: str, leader: bool) -> CheckpointError:
    """The error of a save that failed: which folder, why (a full disk says so: the zip writer of a DCP
    shard reports it as "unexpected pos"), and that `latest` is untouched. The leader removes the partial
    step-N.tmp, giving the space back (Note [Atomic saves])."""
    free = _free_bytes(tmp.parent)
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
    why = f"the disk is full ({free} bytes free on the file system of {tmp.parent}): {cause}" \
        if free is not None and free < _FULL_BELOW else f"a write failed: {cause}"
    return CheckpointError(f"saving step {step} into {tmp} failed: {why}; {tmp.parent / LATEST} still names "
                           "the last complete checkpoint, if any", tmp.parent)


_FULL_BELOW = 1 << 20    # bytes: less than this left after a failed write is a full disk


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _cause(err: dcp.CheckpointException) -> str:
    """The first rank's error, in one line (DCP gathers every rank's traceback)."""
    for rank, (exc, _) in sorted(err.failures.items()):
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
        return f"(rank {rank}) {text[:300]}"
    return str(err).splitlines()[0]
