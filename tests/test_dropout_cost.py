"""Dropout in the cost model: the bytes its kernels move (passes/cost/gemm.py, compute.py) and the masks and
probabilities it keeps (passes/cost/shapes.py `activation_elements`), as the runtime runs it."""

from __future__ import annotations

import dataclasses

import pytest

from hetc.passes.cost import Profiles
from hetc.passes.cost.compute import ComputeModel
from hetc.passes.cost.gemm import DeviceFacts, layer_seconds
from hetc.passes.cost.shapes import LayerKind, activation_elements
from hetc.ir.spec import DTYPE_BYTES, AttentionKind, Checkpointing, DeviceSpec, DType, ModelSpec, PeakSpec
from tests.costspecs import ONE_LANE, cost_model, plan_text

A100 = DeviceFacts(peak=312e12, asymptote=0.8, sms=108, memory_bandwidth=2.0e12, dtype_bytes=2)
BIG = ModelSpec(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=4096, dtype=DType.BF16)
SMALL = ModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=1000, seq=128, dtype=DType.BF16)
BLOCK, EMBED, HEAD = 1, 0, 3   # SMALL's layer indices


def _drop(model: ModelSpec, hidden: float = 0.1, attention: float = 0.1) -> ModelSpec:
    return dataclasses.replace(model, hidden_dropout=hidden, attention_dropout=attention)


def _moved(elements: float, dtype_bytes: int) -> float:
    """A dropout's bytes per pass, written out: forward reads x and writes y and the bool mask; backward reads dy
    and the mask and writes dx."""
    return elements * (dtype_bytes + dtype_bytes + 1)


# ------------------------------------------------------------------ time


@pytest.mark.parametrize("attention", list(AttentionKind))
@pytest.mark.parametrize("micro_batch, tp", [(1, 1), (2, 4)])
def test_a_blocks_dropouts_add_their_bytes_at_the_memory_bandwidth(attention, micro_batch, tp):
    model = dataclasses.replace(BIG, attention=attention)
    base = layer_seconds(model, LayerKind.BLOCK, micro_batch, tp, A100)
    tokens, delta = micro_batch * model.seq, A100.dtype_bytes
    # two hidden dropouts (attention and MLP outputs) over the whole hidden state, as the block's other
    # memory-bound work is counted
    hidden = _moved(2 * tokens * model.hidden, delta)
    # the unfused core's dropout over its probabilities, heads/tp × s × s per sequence; flash's is in its kernel
    scores = micro_batch * model.heads // tp * model.seq ** 2
    probs = _moved(scores, delta) if attention is AttentionKind.UNFUSED else 0.0
    for dropped, extra in [(_drop(model, attention=0.0), hidden), (_drop(model, hidden=0.0), probs),
                           (_drop(model), hidden + probs)]:
        forward, backward = layer_seconds(dropped, LayerKind.BLOCK, micro_batch, tp, A100)
        assert forward - base[0] == pytest.approx(extra / A100.memory_bandwidth, rel=1e-9, abs=1e-15)
        assert backward - base[1] == pytest.approx(extra / A100.memory_bandwidth, rel=1e-9, abs=1e-15)


def test_flash_attentions_dropout_adds_no_time():
    assert layer_seconds(_drop(BIG, hidden=0.0), LayerKind.BLOCK, 1, 1, A100) == \
        layer_seconds(BIG, LayerKind.BLOCK, 1, 1, A100)


def test_the_head_has_no_dropout():
    assert layer_seconds(_drop(BIG), LayerKind.HEAD, 1, 2, A100) == layer_seconds(BIG, LayerKind.HEAD, 1, 2, A100)


@pytest.mark.parametrize("sms", [108, 0], ids=["shaped", "flat"])
def test_the_embeddings_dropout_adds_its_bytes(sms):
    """The embed layer is timed by its bytes on either analytic path; hidden dropout runs on its output."""
    device = DeviceSpec(name="gpu", memory=80e9, peak=PeakSpec(bf16=312e12), memory_bandwidth=2e12, sms=sms)
    tokens, delta = 2 * BIG.seq, DTYPE_BYTES[BIG.dtype]

    def embed(model: ModelSpec) -> tuple[float, float]:
        got = ComputeModel(model, Profiles(), {"gpu": device}).layer("gpu", LayerKind.EMBED, 2, 1)
        return got.forward, got.backward

    gather = 2 * tokens * BIG.hidden * delta    # rows gathered forward, gradients scattered backward
    streamed = 0.9 * 2e12                       # Note [streaming bandwidth]
    assert embed(BIG) == pytest.approx((gather / streamed, gather / streamed))
    with_dropout = (gather + _moved(tokens * BIG.hidden, delta)) / streamed
    assert embed(_drop(BIG)) == pytest.approx((with_dropout, with_dropout))


# ------------------------------------------------------------------ memory


def _kept(model: ModelSpec, idx: int, checkpoint: Checkpointing, **kw) -> tuple[float, float]:
    return activation_elements(model, idx, 2, checkpoint=checkpoint, **kw)


def _grew(model: ModelSpec, idx: int, checkpoint: Checkpointing, **kw) -> tuple[float, float]:
    """(elements, bytes) `model` keeps beyond the same model without dropout."""
    base = _kept(_drop(model, 0.0, 0.0), idx, checkpoint, **kw)
    got = _kept(model, idx, checkpoint, **kw)
    return got[0] - base[0], got[1] - base[1]


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("attention", list(AttentionKind))
def test_a_block_keeps_its_two_hidden_masks_unless_fully_checkpointed(attention, tp, sp):
    model = dataclasses.replace(_drop(SMALL, attention=0.0), attention=attention)
    mask = 2 * SMALL.seq * SMALL.hidden / (tp if sp else 1)   # one byte per element of this rank's hidden state
    for checkpoint in (Checkpointing.NONE, Checkpointing.SELECTIVE):
        assert _grew(model, BLOCK, checkpoint, tp=tp, sequence_parallel=sp) == pytest.approx((0.0, 2 * mask))
    assert _grew(model, BLOCK, Checkpointing.FULL, tp=tp, sequence_parallel=sp) == (0.0, 0.0)


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_unfused_core_keeps_the_dropped_probabilities_and_their_mask(tp, cp):
    model = _drop(dataclasses.replace(SMALL, attention=AttentionKind.UNFUSED), hidden=0.0)
    # heads/tp of s × s per sequence; Ulysses (cp): heads/(tp·cp) of the whole sequence
    scores = 2 * SMALL.heads / (tp * cp) * SMALL.seq ** 2
    # bf16: AV keeps its dropped copy of the probabilities instead of their cast, one bool each more
    assert _grew(model, BLOCK, Checkpointing.NONE, tp=tp, cp=cp) == pytest.approx((0.0, scores))
    for checkpoint in (Checkpointing.SELECTIVE, Checkpointing.FULL):   # recomputed
        assert _grew(model, BLOCK, checkpoint, tp=tp, cp=cp) == (0.0, 0.0)
    # with hidden dropout too: its two masks over this rank's tokens (a 1/cp part of the sequence) beside
    masks = 2 * 2 * SMALL.seq / cp * SMALL.hidden
    assert _grew(_drop(model), BLOCK, Checkpointing.NONE, tp=tp, cp=cp) == pytest.approx((0.0, scores + masks))
    assert _grew(_drop(model), BLOCK, Checkpointing.SELECTIVE, tp=tp, cp=cp) == pytest.approx((0.0, masks))


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP32])
def test_the_unfused_core_keeps_its_softmax_and_avs_input(dtype):
    """Beside what flash attention keeps (q, k, v, output and its fp32 log-sum-exp): the softmax's fp32 output,
    and the probabilities AV reads in the training dtype (the softmax's output itself in fp32, without
    dropout; their dropped copy and its mask with)."""
    flash = dataclasses.replace(SMALL, dtype=dtype)
    unfused = dataclasses.replace(flash, attention=AttentionKind.UNFUSED)
    tokens, scores = 2 * SMALL.seq, 2 * SMALL.heads * SMALL.seq ** 2
    lse = tokens * SMALL.heads * 4
    f = _kept(flash, BLOCK, Checkpointing.NONE)
    assert f[1] == lse
    own = 0.0 if dtype is DType.FP32 else scores
    assert _kept(unfused, BLOCK, Checkpointing.NONE) == pytest.approx((f[0] + own, 4 * scores))
    assert _kept(_drop(unfused, hidden=0.0), BLOCK, Checkpointing.NONE) == \
        pytest.approx((f[0] + scores, 4 * scores + scores))
    # selective recomputes the unfused core (flash's log-sum-exp is counted there as before)
    assert _kept(unfused, BLOCK, Checkpointing.SELECTIVE) == \
        pytest.approx((_kept(flash, BLOCK, Checkpointing.SELECTIVE)[0], 0.0))


@pytest.mark.parametrize("checkpoint", list(Checkpointing))
@pytest.mark.parametrize("tp, sp", [(1, False), (4, False), (4, True)])
def test_the_embed_layer_keeps_its_mask_under_every_checkpointing(checkpoint, tp, sp):
    """The runtime checkpoints blocks only: the embedding's dropout mask stays."""
    assert _kept(SMALL, EMBED, checkpoint, tp=tp, sequence_parallel=sp) == (0.0, 0.0)
    mask = 2 * SMALL.seq * SMALL.hidden / (tp if sp else 1)
    assert _kept(_drop(SMALL), EMBED, checkpoint, tp=tp, sequence_parallel=sp) == pytest.approx((0.0, mask))
    assert _kept(_drop(SMALL), HEAD, checkpoint, tp=tp, sequence_parallel=sp) == \
        _kept(SMALL, HEAD, checkpoint, tp=tp, sequence_parallel=sp)


def test_no_dropout_keeps_no_mask():
    """At 0 the masks and dropped copies are gone: flash keeps only its log-sum-exp beyond the dtype's tensors."""
    for checkpoint in Checkpointing:
        assert _kept(_drop(SMALL, 0.0, 0.0), EMBED, checkpoint) == (0.0, 0.0)
    flash = _kept(_drop(SMALL, 0.0, 0.0), BLOCK, Checkpointing.NONE)
    assert flash[1] == 2 * SMALL.seq * SMALL.heads * 4


def test_the_estimate_counts_every_layers_masks(tmp_path):
    """CostModel.activation_bytes (the estimate's, and the compiled program's memory check's) reads the same
    count: the embedding's mask and each block's two."""
    text = plan_text(ONE_LANE)
    dropped = text.replace("  activation_checkpoint", "  hidden_dropout = 0.1\n  activation_checkpoint")
    assert dropped != text
    base, cm = cost_model(tmp_path, text), cost_model(tmp_path, dropped)
    assert cm.model.hidden_dropout == 0.1
    layers = cm.model.layers
    mask = cm.model.seq * cm.model.hidden   # micro_batch 1, tp 1, one byte each
    assert cm.activation_bytes(0, 0) - base.activation_bytes(0, 0) == pytest.approx((1 + 2 * layers) * mask)
