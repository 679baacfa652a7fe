"""The single-process reference trainer: the golden numbers every plan must reproduce.

The whole model is one ministage on one process, with one flat buffer and
the same flat optimizer, data, schedule and clipping as the interpreter.

Note [Loss normalisation]
A step has m = global_batch / micro_batch microbatches. Each microbatch's
loss is the mean token cross-entropy over its b × S tokens, and backward
runs on loss / m. Every microbatch has the same number of tokens, so the
summed gradient is the gradient of the mean loss over the global batch,
however the microbatches are spread over lanes: a lane with 3 microbatches
and one with 1 contribute 3/m and 1/m, and their all-reduced sum equals the
one-device gradient. The reported step loss is the mean of the microbatch
losses (summed in float64).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from hetc.hf.weights import pretrained_dir
from hetc.runtime.data import DataSource, make_data_source, make_eval_source
from hetc.runtime.flat import FlatParams
from hetc.runtime.hf_load import load_whole
from hetc.runtime.nn.moe import AuxLoss, aux_loss_mean, clear_aux_tallies, moe_layers, reported_aux_losses
from hetc.runtime.nn.dropout import seed_step
from hetc.runtime.nn.model import build_ministage, compute_dtype, grad_dtype
from hetc.runtime.optim import clip_coefficient, decayed_spans, grad_sq_sum, init_state, lr_at, optimizer_step
from hetc.runtime.nn.tensor_parallel import shard_infos
from hetc.ir.spec import ModelSpec, TrainSpec

__all__ = ["ReferenceResult", "train_reference"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    losses: tuple[float, ...]        # per step: mean microbatch loss
    grad_norms: tuple[float, ...]    # per step: global gradient norm before clipping
    step_times: tuple[float, ...]    # per step: wall seconds (the compute-only baseline)
    params: dict[str, Tensor]        # after the last step: fp32, by global parameter name
    val_losses: tuple[float, ...] = ()   # per evaluation (train { eval_every }): mean over eval_batches
    # per reported MoE auxiliary loss (`reported_aux_losses`), its value at each step: Note [load-balancing loss]
    aux_losses: dict[AuxLoss, tuple[float, ...]] = field(default_factory=dict)


def train_reference(model: ModelSpec, train: TrainSpec, *, base_dir: Path | str = ".", steps: int | None = None,
                    device: torch.device | str = "cpu", data: DataSource | None = None) -> ReferenceResult:
    """Train `model` on `train`'s data for `steps` (default train.steps) steps on one process.

    `base_dir` resolves a text data path (the spec's folder); `data`
    overrides the data source.
    """
    module = build_ministage(model, range(model.num_model_layers), seed=train.seed, device=device)
    flat = FlatParams(module, dtype=compute_dtype(model.dtype), grad_dtype=grad_dtype(model))
    if (hf_dir := pretrained_dir(model)) is not None:   # every plan's ranks' initial weights (runtime/hf_load.py)
        flat.load(load_whole(flat.layout, shard_infos(module), hf_dir))
    state = init_state(model.optimizer, flat.master)
    decayed = decayed_spans(model.optimizer, flat.layout, flat.layout.shard_range(0))
    data = data if data is not None else make_data_source(model, train, base_dir)
    held_out = make_eval_source(model, train, base_dir)
    num_mb = train.global_batch // train.micro_batch
    layers = moe_layers([module])
    for moe in layers:    # Note [load-balancing loss]: its gradient is the loss's seed
        moe.aux_seed = 1.0 / num_mb
    losses, norms, times, vals = [], [], [], []
    aux: dict[AuxLoss, list[float]] = {kind: [] for kind in reported_aux_losses(model.moe)}
    for step in range(train.steps if steps is None else steps):
        start = time.perf_counter()
        seed_step(train.seed, step, 0)     # one rank: the stream a 1-rank plan's rank 0 draws (Note [dropout streams])
        flat.zero_grad()
        clear_aux_tallies(layers)
        total = 0.0
        for mb in range(num_mb):
            tokens, labels = data.get_microbatch(step, mb)
            loss = module(tokens.to(device), labels.to(device))
            (loss / num_mb).backward()
            total += loss.item()
        norm_sq = grad_sq_sum(flat.grad_shard)
        if train.grad_clip > 0:
            flat.grad.mul_(clip_coefficient(norm_sq, train.grad_clip))
        optimizer_step(model.optimizer, flat.master, flat.grad_shard, state, lr=lr_at(train, step), step=step,
                       decayed=decayed)
        flat.publish_master()
        times.append(time.perf_counter() - start)
        losses.append(total / num_mb)
        norms.append(float(norm_sq) ** 0.5)
        for kind, values in aux.items():
            tallied = sum(float(loss) for moe in layers for loss in moe.tallied[kind])
            values.append(aux_loss_mean(kind, tallied, model, num_mb))
        if held_out is not None and (step + 1) % train.eval_every == 0:
            vals.append(_validation_loss(module, held_out, train.eval_batches, num_mb, device))
        log.debug("reference step %d: loss %.6f, grad norm %.4f", step, losses[-1], norms[-1])
    return ReferenceResult(tuple(losses), tuple(norms), tuple(times), flat.named_master(), tuple(vals),
                           {kind: tuple(values) for kind, values in aux.items()})


@torch.no_grad()
def _validation_loss(module, data: DataSource, batches: int, num_mb: int, device) -> float:
    """The mean over `batches` validation batches of their mean microbatch loss (runtime/evaluate.py)."""
    total = 0.0
    module.eval()    # no dropout
    for batch in range(batches):
        total += sum(module(*(t.to(device) for t in data.get_microbatch(batch, mb))).item()
                     for mb in range(num_mb)) / num_mb
    module.train()
    return total / batches
