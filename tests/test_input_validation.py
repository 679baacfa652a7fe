"""Every input validated where it enters (issue 28, findings 8, 9, 10, 13 and 14).

Profiles with non-finite, negative or zero times; raw token files whose
declared dtype contradicts their contents or sidecar; a token file cut short
while it is read; Megatron .idx/.bin pairs that do not agree; a truncated
safetensors file. Each is a one-line error naming the file (located in the
spec where a spec names it), exit 2, never a hang, a traceback or training
on the wrong stream.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetc.cli import main
from hetc.ir.errors import SpecError
from hetc.passes.cost import ProfileError
from hetc.passes.cost.sources import load_profiles
from hetc.runtime.data import DataError, make_data_source
from hetc.ir.spec import DataKind, DataSpec, ModelSpec, TokenDType, TrainSpec
from hetc.ir.tokenfile import write_megatron_index, write_sidecar
from tests.conftest import DEMO, ROOT

MEASURED = ROOT / "tests" / "profiles" / "cpu2-demo.json"
MODEL = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=256, seq=16)
HANG_GUARD_S = 120    # a regression that hangs fails here instead of stalling the suite


# ---------------------------------------------------------------- profiles (findings 9, 10)


def _profile_with_block_time(tmp_path: Path, value: float) -> tuple[Path, str]:
    """The measured demo profile with one block's forward time replaced; (the file, the field's path)."""
    data = json.loads(MEASURED.read_text())
    row = next(i for i, r in enumerate(data["layers"]) if r["layer"] == "block")
    data["layers"][row]["forward_s"] = value
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(data))    # json writes NaN and Infinity as those bare tokens
    return path, f"layers[{row}].forward_s"


@pytest.mark.parametrize("value, shown", [(float("nan"), "NaN"), (-1e-3, "-0.001"), (0.0, "0.0")],
                         ids=["nan", "negative", "zero"])
def test_finding_9_a_profile_time_that_is_not_finite_and_positive_is_refused(value, shown, tmp_path, capsys):
    path, field = _profile_with_block_time(tmp_path, value)
    assert main(["explain", str(DEMO / "pp.het"), "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:1:1: error: {field} is {shown}; "), err
    assert "Traceback" not in err


def test_finding_10_a_profile_with_infinity_is_refused_not_a_hang(tmp_path):
    path, field = _profile_with_block_time(tmp_path, float("inf"))
    assert "Infinity" in path.read_text()
    for verb in ("explain", "compile"):
        extra = ["-o", str(tmp_path / "out")] if verb == "compile" else []
        done = subprocess.run([sys.executable, "-m", "hetc", verb, str(DEMO / "pp.het"), "--profile", str(path),
                               *extra], check=False, capture_output=True, text=True, timeout=HANG_GUARD_S,
                               cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert f"{path}:1:1: error: {field} is Infinity; " in done.stderr


def test_finding_10_the_schedule_simulation_refuses_a_time_it_can_never_reach():
    # in a subprocess: were the guard gone, the simulation would spin for ever
    code = """
from hetc.ir.errors import InternalError
from hetc.passes.lower.lane_sim import Policy, simulate
ops = [("F", 0, 0), ("F", 0, 1)]
try:
    simulate({(0, 0): Policy(ops, [])}, lambda op: [], lambda op: float("nan"))
except InternalError as err:
    print("refused:", err)
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert "refused: schedule simulation: the duration of ('F', 0, 0) is nan s" in done.stdout, done.stderr


def test_finding_10_a_zorse_folder_with_infinity_names_the_file_and_field(tmp_path):
    latencies = tmp_path / "data" / "model_latencies.json"
    latencies.parent.mkdir()
    latencies.write_text('{"m": {"a100": {"512": {"float16": [[1.0, Infinity], [2.0, 0.5]]}}}}')
    with pytest.raises(ProfileError, match=r"m\.a100\.512\.float16\[0\]\[1\] is Infinity") as caught:
        load_profiles([tmp_path])
    assert caught.value.file == str(latencies)


# ---------------------------------------------------------------- token files (findings 8, 13)


def _demo_copy(tmp_path: Path, data_block: str) -> Path:
    """The demo folder under tmp_path with job.het's data block replaced; its single-rank plan."""
    demo = tmp_path / "demo"
    shutil.copytree(DEMO, demo)
    shutil.copy(DEMO.parent / "catalog.het", tmp_path / "catalog.het")
    job = demo / "job.het"
    text = job.read_text()
    old = 'data text {\n    path = "data/tiny.txt"\n  }'
    assert old in text
    job.write_text(text.replace(old, data_block))
    return demo / "single.het"


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if needle in line)


def _ids(count: int = 4000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, count)


def test_finding_8_uint32_ids_declared_uint16_are_refused_at_check_and_at_run_start(tmp_path, capsys):
    spec = _demo_copy(tmp_path, 'data tokens {\n    path = "ids.bin"\n    dtype = uint16\n  }')
    ids = spec.parent / "ids.bin"
    _ids().astype("<u4").tofile(ids)
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    job = spec.parent / "job.het"
    assert err.startswith(f"{job}:{_line_of(job, 'dtype = uint16')}:13: error: '{ids}' read as uint16 has the id "
                          "0 at every odd position"), err
    assert "is it dtype = uint32?" in err
    data = DataSpec(kind=DataKind.TOKENS, path=str(ids), dtype=TokenDType.UINT16)
    with pytest.raises(SpecError, match="that is how uint32 ids look as uint16"):
        make_data_source(MODEL, TrainSpec(global_batch=8, micro_batch=2, data=data))


def test_finding_8_uint16_ids_declared_uint32_are_ids_beyond_the_vocabulary(tmp_path, capsys):
    spec = _demo_copy(tmp_path, 'data tokens {\n    path = "ids.bin"\n    dtype = uint32\n  }')
    _ids().astype("<u2").tofile(spec.parent / "ids.bin")
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "outside the model's vocab = 256; uint16 ids read as uint32 look like this: is it dtype = uint16?" in err


def test_finding_8_a_raw_file_whose_size_is_not_whole_ids_is_refused_at_its_dtype(tmp_path, capsys):
    spec = _demo_copy(tmp_path, 'data tokens {\n    path = "ids.bin"\n    dtype = uint32\n  }')
    (spec.parent / "ids.bin").write_bytes(_ids().astype("<u2").tobytes() + b"\x01\x00")   # 4002 bytes
    assert main(["check", str(spec)]) == 2
    job = spec.parent / "job.het"
    assert f"{job}:{_line_of(job, 'dtype = uint32')}:13: error: " in capsys.readouterr().err


def test_finding_8_a_declared_dtype_that_contradicts_the_sidecar_is_refused(tmp_path):
    ids = tmp_path / "ids.bin"
    _ids().astype("<u4").tofile(ids)
    write_sidecar(ids, {"dtype": "uint32", "vocab": 256, "tokens": 4000})
    data = DataSpec(kind=DataKind.TOKENS, path=str(ids), dtype=TokenDType.UINT16)
    with pytest.raises(SpecError, match=r"dtype = uint16, but '.*ids\.bin\.json' says the ids of .* are uint32"):
        make_data_source(MODEL, TrainSpec(global_batch=8, micro_batch=2, data=data))
    agreed = DataSpec(kind=DataKind.TOKENS, path=str(ids), shuffle=False)     # the sidecar gives the dtype
    tokens, _ = make_data_source(MODEL, TrainSpec(global_batch=8, micro_batch=2, data=agreed)).get_microbatch(0, 0)
    assert tokens[0].tolist() == _ids()[:MODEL.seq].tolist()


def test_finding_13_a_token_file_cut_short_while_read_is_named(tmp_path):
    ids = tmp_path / "ids.bin"
    _ids().astype("<u2").tofile(ids)
    data = DataSpec(kind=DataKind.TOKENS, path=str(ids), dtype=TokenDType.UINT16, shuffle=False)
    source = make_data_source(MODEL, TrainSpec(global_batch=8, micro_batch=2, data=data))
    source.get_microbatch(0, 0)
    os.truncate(ids, 1000)     # 500 ids left: step 10 reads from id 1280
    with pytest.raises(DataError, match=f"'{ids}' ends at byte 1000, before ids .*: was it cut short"):
        source.get_microbatch(10, 0)


def test_finding_13_a_text_file_cut_short_while_read_is_named(tmp_path):
    text = tmp_path / "t.txt"
    shutil.copy(DEMO / "data" / "tiny.txt", text)
    data = DataSpec(kind=DataKind.TEXT, path=str(text), shuffle=False)
    source = make_data_source(MODEL, TrainSpec(global_batch=8, micro_batch=2, data=data))
    os.truncate(text, 100)
    with pytest.raises(DataError, match=f"'{text}' ends at byte 100"):
        source.get_microbatch(3, 0)


# ---------------------------------------------------------------- Megatron pairs, safetensors (finding 14)


def _megatron(directory: Path, lengths: list[int]) -> Path:
    ids = _ids(sum(lengths)).astype("<u2")
    ids.tofile(directory / "m.bin")
    write_megatron_index(directory / "m.idx", TokenDType.UINT16, lengths)
    return directory / "m"


def test_finding_14_a_megatron_pair_that_disagrees_is_refused_at_check_with_what_is_wrong(tmp_path, capsys):
    spec = _demo_copy(tmp_path, 'data tokens {\n    path = "m"\n  }')
    prefix = _megatron(spec.parent, [1000, 1500, 1500])
    assert main(["check", str(spec)]) == 0
    capsys.readouterr()
    job, bin_, idx = spec.parent / "job.het", prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    where = f"{job}:{_line_of(job, 'path = ')}:12: error: "

    os.truncate(bin_, 7000)
    assert main(["check", str(spec)]) == 2
    assert capsys.readouterr().err.startswith(f"{where}'{idx}' says its 3 sequences hold 4000 ids (8000 bytes), "
                                              f"but '{bin_}' has 7000 bytes: was it cut short?")

    _megatron(spec.parent, [1000, 1500, 1500])
    raw = bytearray(idx.read_bytes())
    pointer_1 = 34 + 4 * 3 + 8                       # the header, 3 lengths, then sequence 1's byte offset
    raw[pointer_1:pointer_1 + 8] = (2004).to_bytes(8, "little")
    idx.write_bytes(bytes(raw))
    assert main(["check", str(spec)]) == 2
    assert capsys.readouterr().err.startswith(f"{where}sequence 1 of '{idx}' starts at byte 2004 of '{bin_}', but "
                                              "sequence 0 ends at byte 2000: the sequences do not lie back to back")

    raw[pointer_1:pointer_1 + 8] = (2000).to_bytes(8, "little")
    raw[17] = 5                                      # the dtype code: int64
    idx.write_bytes(bytes(raw))
    assert main(["check", str(spec)]) == 2
    assert "stores int64 ids; hetc reads uint16 (code 8) and int32 (code 4)" in capsys.readouterr().err

    raw[17] = 8
    raw[9:17] = (3).to_bytes(8, "little")            # the version
    idx.write_bytes(bytes(raw))
    assert main(["check", str(spec)]) == 2
    assert "is version 3 of Megatron's index; hetc reads version 1" in capsys.readouterr().err


def test_finding_14_a_truncated_safetensors_file_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hetc.hf.config import HfError
    from hetc.hf.weights import WeightReader, header_shapes

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(64, 64), "b": torch.ones(64)}, str(path))
    assert header_shapes(tmp_path) == {"a": (64, 64), "b": (64,)}
    os.truncate(path, path.stat().st_size - 100)
    for read in (lambda: header_shapes(tmp_path), lambda: WeightReader(tmp_path)):
        with pytest.raises(HfError, match=f"{path} is cut short: its header places tensor data up to byte"):
            read()


def _rewrite_header(path, edit) -> None:
    """`path`'s safetensors header passed through `edit`, the tensor bytes kept."""
    import struct

    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + size]))
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


@pytest.mark.parametrize("edit", [
    lambda h: {**h, "a": {**h["a"], "dtype": "x"}},
    lambda h: {**h, "a": {**h["a"], "shape": [64, "x"]}},
    lambda h: {**h, "a": {**h["a"], "shape": [64, 65]}},                     # more elements than its bytes
    lambda h: {**h, "b": {**h["b"], "data_offsets": [0, 256]}},              # overlapping the tensor before it
    lambda h: {**h, "b": {k: v for k, v in h["b"].items() if k != "dtype"}},
    lambda h: {**h, "b": []},
], ids=["dtype", "shape type", "shape size", "overlap", "no dtype", "not an entry"])
def test_a_safetensors_header_safetensors_would_refuse_is_named_by_check(tmp_path, edit):
    """A header that only safetensors' own read refused: `hetc check` passed and every rank of the run failed
    with an internal error (fuzzing, 2026-12-06)."""
    import torch
    from safetensors.torch import save_file

    from hetc.hf.config import HfError
    from hetc.hf.weights import header_shapes

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(64, 64), "b": torch.ones(64)}, str(path))
    _rewrite_header(path, edit)
    with pytest.raises(HfError, match=f"{path} is not a safetensors file: the header's entry for '[ab]' is not"):
        header_shapes(tmp_path)


@pytest.mark.parametrize("weight_map", [{"a": None}, {"a": 1.5}, {"a": "../model.safetensors"}, ["a"]])
def test_an_index_naming_no_file_beside_it_is_named(tmp_path, weight_map):
    from hetc.hf.config import HfError
    from hetc.hf.weights import header_shapes

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(HfError, match="weight_map must map each tensor to the name of a file beside it"):
        header_shapes(tmp_path)


def test_weights_a_rank_cannot_read_are_a_usage_error(tmp_path, monkeypatch, capsys):
    """Weights changed after the check (a copy still being written): the rank's HfError is bad input, exit 2."""
    from hetc import rank
    from hetc.hf.config import HfError

    plan = tmp_path / "plan"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(plan)]) == 0

    def unreadable(*_args, **_kwargs):
        raise HfError("cannot read model.embed_tokens.weight from w/model.safetensors: invalid offset")

    monkeypatch.setattr(rank, "run_worker", unreadable)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert main(["run", str(plan)]) == 2
    assert "hetc run: error: cannot read model.embed_tokens.weight from w/model.safetensors" in capsys.readouterr().err


def test_finding_8_prepare_megatron_writes_a_sidecar_that_check_holds_the_model_to(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hetc.passes.data_check import check_data
    from hetc.ir.tokenfile import inspect_tokens, sidecar_path

    words = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(299)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(f"w{(7 * i + d) % 299}" for i in range(40))}) + "\n"
                              for d in range(5)))
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tmp_path / "tok"), "--eos", "<eos>",
                 "-o", str(tmp_path / "m"), "--megatron"]) == 0
    assert str(sidecar_path(tmp_path / "m.bin")) in capsys.readouterr().out
    tf = inspect_tokens(tmp_path / "m", None)
    assert (tf.vocab, tf.num_tokens, tf.dtype) == (300, 205, "uint16")
    data = DataSpec(kind=DataKind.TOKENS, path=str(tmp_path / "m"))
    errors: list = []
    check_data(MODEL, TrainSpec(global_batch=8, data=data), tmp_path, errors)
    larger = (f"'{tmp_path / 'm'}' was written by the tokenizer 'tok' with a vocabulary of 300, larger than the "
              "model's vocab = 256")
    assert [e.message for e in errors] == [larger]
