"""`data blend` mixes text and token files by weight, by Megatron-LM's rule (Note [Blends] in runtime/data.py)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from hetc.cli import main as hetc_main
from hetc.ir.spec import BlendSourceSpec, DataKind, DataSpec, ModelSpec, TrainSpec
from hetc.runtime.checkpoint_files import CheckpointError
from hetc.runtime.checkpoint_identity import check_resumable, write_data_identity
from hetc.runtime.data import BlendedData, TextData, blend_period, make_data_source, make_eval_source
from tests.conftest import DEMO, demo_job

MODEL = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=256, seq=16)


def megatron_blend(weights: list[float], n: int) -> list[tuple[int, int]]:
    """(source, its sample) of each of the first n samples by Megatron-LM's blending rule: the source whose
    count falls furthest below its share of the samples so far, the first on a tie."""
    shares = [w / sum(weights) for w in weights]
    taken, out = [0] * len(shares), []
    for i in range(n):
        errors = [s * (i + 1) - c for s, c in zip(shares, taken)]
        d = int(np.argmax(errors))
        out.append((d, taken[d]))
        taken[d] += 1
    return out


class _Numbered:
    """A source whose sequence k is [d, k]: says which source and which of its sequences a blend read."""

    def __init__(self, d: int):
        self.d = d

    def sequence(self, k: int) -> torch.Tensor:
        return torch.tensor([self.d, k])


@pytest.mark.parametrize("weights", [[0.75, 0.25], [0.5, 0.25, 0.25], [5, 3], [1, 1, 2, 4]])
def test_the_blend_is_megatrons_index_sequence_for_sequence(weights):
    blend = BlendedData(sources=[_Numbered(d) for d in range(len(weights))], weights=weights,  # type: ignore[misc]
                        seed=0, seq=1, micro_batch=1, global_batch=1)
    assert [tuple(blend.sequence(g).tolist()) for g in range(1000)] == megatron_blend(weights, 1000)


def test_a_period_holds_each_source_by_its_share():
    source, index, slots = blend_period([0.7, 0.3])
    assert len(source) == 10 and slots == [7, 3]
    for d, count in enumerate(slots):
        assert sorted(index[source == d].tolist()) == list(range(count))
    source, _, slots = blend_period([1.0, math.sqrt(2)])     # no whole period: 65,536 slots, largest remainders
    assert len(source) == 65_536 and sum(slots) == 65_536
    assert abs(slots[0] / 65_536 - 1 / (1 + math.sqrt(2))) < 1 / 65_536


def test_sequences_of_a_blend_are_those_of_its_files(tmp_path):
    """Each sequence is the next of the source the index names, as that file alone would give it (its own
    shuffled epochs), and over many steps each file gives its share."""
    (tmp_path / "low.txt").write_bytes(bytes(range(128)) * 3)
    (tmp_path / "high.txt").write_bytes(bytes(range(128, 256)) * 3)
    sources = (BlendSourceSpec(kind=DataKind.TEXT, path="low.txt", weight=3),
               BlendSourceSpec(kind=DataKind.TEXT, path="high.txt", weight=1))
    train = TrainSpec(global_batch=8, micro_batch=2, seed=5, data=DataSpec(kind=DataKind.BLEND, sources=sources))
    blend = make_data_source(MODEL, train, tmp_path)
    common = {"seed": 5, "seq": MODEL.seq, "micro_batch": 2, "global_batch": 8}
    files = [TextData(text=(tmp_path / f"{name}.txt").read_bytes(), epochs=(i,), **common)   # type: ignore[arg-type]
             for i, name in enumerate(("low", "high"))]
    expected = [files[d].sequence(k)[:-1] for d, k in megatron_blend([3, 1], 80)]
    tokens = torch.cat([blend.get_microbatch(step, mb)[0] for step in range(10) for mb in range(4)])
    assert torch.equal(tokens, torch.stack(expected))
    assert int((tokens[:, 0] >= 128).sum()) == 20      # high.txt's quarter of 80 sequences


def test_eval_share_holds_out_the_end_of_every_source_and_blends_them_as_trained(tmp_path):
    """Megatron-LM's --split on a blend: each file's last windows are held out of training, and validation
    reads them, in order, blended by the same weights."""
    (tmp_path / "low.txt").write_bytes(bytes(range(128)) * 3)
    (tmp_path / "high.txt").write_bytes(bytes(range(128, 256)) * 5)
    sources = (BlendSourceSpec(kind=DataKind.TEXT, path="low.txt", weight=3),
               BlendSourceSpec(kind=DataKind.TEXT, path="high.txt", weight=1))
    train = TrainSpec(global_batch=8, micro_batch=2, seed=5, eval_share=0.1, eval_every=10,
                      data=DataSpec(kind=DataKind.BLEND, sources=sources))
    trained, held = make_data_source(MODEL, train, tmp_path), make_eval_source(MODEL, train, tmp_path)
    assert isinstance(trained, BlendedData) and isinstance(held, BlendedData)
    for name, kept, out in zip(("low", "high"), trained.sources, held.sources):
        ids = np.frombuffer((tmp_path / f"{name}.txt").read_bytes(), np.uint8)
        windows = (len(ids) - 1) // MODEL.seq
        cut = (windows - math.ceil(0.1 * windows)) * MODEL.seq
        assert np.array_equal(np.asarray(kept.tokens[:]), ids[:cut + 1])
        assert np.array_equal(np.asarray(out.tokens[:]), ids[cut:])
        assert not out.shuffle
    assert held.per_period == trained.per_period == [3, 1]
    first = np.asarray(held.sources[0].tokens[:MODEL.seq + 1])    # low.txt's first held-out window
    assert held.sequence(0).tolist() == first.tolist()      # validation's sequence 0


def test_a_checkpoint_of_another_blend_is_refused(tmp_path):
    """A resume compares the blend it was saved with: its sources' files and weights (data.json)."""
    shutil.copy(DEMO / "data" / "tiny.txt", tmp_path / "tiny.txt")

    def train(weight: float) -> TrainSpec:
        sources = (BlendSourceSpec(kind=DataKind.TEXT, path=str(tmp_path / "tiny.txt"), weight=weight),
                   BlendSourceSpec(kind=DataKind.TEXT, path=str(tmp_path / "tiny.txt"), weight=1))
        return TrainSpec(global_batch=8, data=DataSpec(kind=DataKind.BLEND, sources=sources))
    write_data_identity(MODEL, train(3), tmp_path)
    check_resumable(tmp_path, MODEL, train(3))
    with pytest.raises(CheckpointError, match=r"sources\[0\]\.weight"):
        check_resumable(tmp_path, MODEL, train(2))


def test_a_blended_job_compiles_and_runs_from_its_plan_directory(tmp_path, capfd):
    """The plan directory's spec names each source's file relative to itself (hetc/plandir.py), so the plan
    runs wherever it is."""
    shutil.copy(DEMO / "data" / "tiny.txt", tmp_path / "tiny.txt")
    one = f'  data text {{\n    path = "{DEMO / "data" / "tiny.txt"}"\n  }}\n'
    blend = ('  data blend {\n    source text { path = "tiny.txt", weight = 3 }\n'
             '    source text { path = "tiny.txt", shuffle = false }\n  }\n')
    (tmp_path / "job.het").write_text(demo_job((one, blend)))
    shutil.copy(DEMO / "single.het", tmp_path / "single.het")
    assert hetc_main(["compile", str(tmp_path / "single.het"), "-o", str(tmp_path / "out" / "plan")]) == 0
    written = (tmp_path / "out" / "plan" / "plan.het").read_text()
    assert "data blend {" in written and written.count('path = "../../tiny.txt"') == 2, written
    assert hetc_main(["run", str(tmp_path / "out" / "plan"), "--local", "--steps", "2"]) == 0
    assert "step 2/" in capfd.readouterr().out
