"""Training data: plan-independent microbatches, byte-level text, the bundled demo text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetc.ir.errors import SpecError
from hetc.compiler import load_checked
from hetc.passes.validate_runtime import check_text_vocab
from hetc.runtime.data import SyntheticData, TextData, make_data_source
from hetc.ir.spec import DataKind, DataSpec, ModelSpec, TrainSpec
from tests.conftest import DEMO

MODEL = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=256, seq=16)


def job(kind: DataKind = DataKind.SYNTHETIC, micro_batch: int = 2, path: str = "") -> TrainSpec:
    return TrainSpec(global_batch=8, micro_batch=micro_batch, seed=3, data=DataSpec(kind=kind, path=path))


def text_job(micro_batch: int = 2) -> TrainSpec:
    return job(DataKind.TEXT, micro_batch, "data/tiny.txt")


@pytest.mark.parametrize("make", [job, text_job], ids=["synthetic", "text"])
def test_microbatches_are_a_function_of_step_and_index(make):
    a = make_data_source(MODEL, make(), DEMO)
    b = make_data_source(MODEL, make(), DEMO)
    b.get_microbatch(5, 3)  # what else a rank loaded first changes nothing
    for step, mb in [(0, 0), (2, 1), (7, 3)]:
        ta, la = a.get_microbatch(step, mb)
        tb, lb = b.get_microbatch(step, mb)
        assert torch.equal(ta, tb) and torch.equal(la, lb)
        assert ta.shape == la.shape == (2, MODEL.seq) and ta.dtype == la.dtype == torch.int64
    assert not torch.equal(a.get_microbatch(0, 0)[0], a.get_microbatch(0, 1)[0])
    assert not torch.equal(a.get_microbatch(0, 0)[0], a.get_microbatch(1, 0)[0])


@pytest.mark.parametrize("make", [job, text_job], ids=["synthetic", "text"])
def test_a_step_holds_the_same_sequences_at_any_micro_batch_size(make):
    by_two = make_data_source(MODEL, make(micro_batch=2), DEMO)
    by_four = make_data_source(MODEL, make(micro_batch=4), DEMO)
    two = torch.cat([by_two.get_microbatch(1, mb)[0] for mb in range(4)])
    four = torch.cat([by_four.get_microbatch(1, mb)[0] for mb in range(2)])
    assert torch.equal(two, four)


@pytest.mark.parametrize("make", [job, text_job], ids=["synthetic", "text"])
def test_labels_are_the_next_tokens(make):
    tokens, labels = make_data_source(MODEL, make(), DEMO).get_microbatch(0, 0)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < MODEL.vocab


def test_text_windows_come_from_the_file_and_an_epoch_visits_each_once():
    text = bytes(range(130))  # every byte distinct: a window's content says where it starts
    data = TextData(text=text, seed=1, seq=8, micro_batch=1, global_batch=1)
    assert data.num_windows == (130 - 1) // 8
    for epoch in range(2):
        starts = []
        for g in range(epoch * data.num_windows, (epoch + 1) * data.num_windows):
            window = data.sequence(g).tolist()
            assert window == list(range(window[0], window[0] + 9))
            starts.append(window[0])
        assert sorted(starts) == [8 * i for i in range(data.num_windows)]
        assert starts != sorted(starts), "shuffled"


def test_synthetic_tokens_cover_the_vocabulary():
    data = SyntheticData(vocab=11, seed=0, seq=64, micro_batch=4, global_batch=4)
    tokens, _ = data.get_microbatch(0, 0)
    assert set(tokens.unique().tolist()) == set(range(11))


def test_text_needs_a_byte_vocabulary():
    small = dataclasses.replace(MODEL, vocab=100)
    assert check_text_vocab(MODEL, text_job()) is None and check_text_vocab(small, job()) is None
    assert "vocab >= 256" in check_text_vocab(small, text_job())
    with pytest.raises(SpecError, match="vocab >= 256"):
        make_data_source(small, text_job(), DEMO)


def test_text_file_errors_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        make_data_source(MODEL, job(DataKind.TEXT, path="missing.txt"), tmp_path)
    (tmp_path / "short.txt").write_bytes(b"too short")
    with pytest.raises(SpecError, match="needs 17"):
        make_data_source(MODEL, job(DataKind.TEXT, path="short.txt"), tmp_path)


def test_the_demo_text_is_bundled_public_domain_ascii():
    text = (DEMO / "data" / "tiny.txt").read_bytes()
    assert 30_000 <= len(text) <= 60_000
    assert all(b == 10 or 32 <= b < 127 for b in text)
    assert b"Four score and seven years ago" in text
    readme = (DEMO / "data" / "README.md").read_text()
    assert "public domain" in readme


def test_the_demo_job_reads_its_text():
    loaded, _ = load_checked(DEMO / "job.het")
    source = make_data_source(loaded.spec.model, loaded.spec.train, loaded.path.parent)
    assert isinstance(source, TextData)
    tokens, _ = source.get_microbatch(0, 0)
    assert tokens.shape == (loaded.spec.train.micro_batch, loaded.spec.model.seq)
