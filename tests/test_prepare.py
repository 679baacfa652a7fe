"""`hetc data prepare` and `data tokens`: a tokenizer built here, JSON lines to training, both layouts.

The BPE tokenizer is trained in the test on the demo text (the `tokenizers`
package, nothing downloaded); the corpus is a few MB of JSON lines cut from
the same text by a seeded generator.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys

import numpy as np
import pytest
import torch

from hetc.cli import main
from hetc.ir.errors import SpecError
from hetc.runtime.data import DataError, Windows, make_data_source, make_eval_source
from hetc.ir.spec import DataKind, DataSpec, ModelSpec, TokenDType, TrainSpec
from hetc.ir.tokenfile import HETC_OFFSET, Layout, inspect_tokens
from tests.conftest import DEMO

EOS = "<|endoftext|>"
VOCAB = 320
SEQ = 16


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((DEMO / "data" / "tiny.txt").read_text().splitlines(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 3 MB of JSON lines: documents of 1 to 40 consecutive lines of the demo text."""
    lines = (DEMO / "data" / "tiny.txt").read_text().splitlines()
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    size = 0
    with open(path, "w") as f:
        while size < 3_000_000:
            start = rng.randrange(len(lines))
            doc = "\n".join(lines[start:start + rng.randint(1, 40)])
            row = json.dumps({"id": size, "text": doc}) + "\n"
            f.write(row)
            size += len(row)
    return path


@pytest.fixture(scope="module")
def prepared(tokenizer_dir, corpus, tmp_path_factory):
    """The corpus in both layouts: {hetc: OUT, megatron: PREFIX}."""
    out = tmp_path_factory.mktemp("tokens")
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer_dir), "-o", str(out / "c.tok")]) == 0
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer_dir), "-o", str(out / "c"),
                 "--megatron"]) == 0
    return {"hetc": out / "c.tok", "megatron": out / "c"}


def _expected_ids(tokenizer_dir, corpus) -> np.ndarray:
    """What the file must hold, computed directly: each document's encoding, then EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    ids = []
    for line in corpus.read_text().splitlines():
        ids += tok.encode(json.loads(line)["text"], add_special_tokens=False).ids + [eos]
    return np.asarray(ids)


def source(path, shuffle: bool, micro_batch: int = 2, **train_keys):
    model = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=VOCAB, seq=SEQ)
    data = DataSpec(kind=DataKind.TOKENS, path=str(path), shuffle=shuffle)
    return make_data_source(model, TrainSpec(global_batch=8, micro_batch=micro_batch, seed=5, data=data,
                                             **train_keys))


def test_the_file_holds_every_document_then_eos_after_a_header(prepared, tokenizer_dir, corpus):
    want = _expected_ids(tokenizer_dir, corpus)
    tf = inspect_tokens(prepared["hetc"], None)
    assert (tf.layout, tf.dtype, tf.vocab, tf.tokenizer, tf.num_tokens) == \
        (Layout.HETC, "uint16", VOCAB, tokenizer_dir.name, len(want))
    stored = np.memmap(prepared["hetc"], dtype="<u2", mode="r", offset=HETC_OFFSET)
    assert np.array_equal(stored, want)
    header = json.loads(prepared["hetc"].read_bytes()[12:HETC_OFFSET])
    assert header["documents"] == len(corpus.read_text().splitlines()) and header["eos"] == want[-1]


def test_megatron_index_describes_one_sequence_per_document(prepared, corpus):
    tf = inspect_tokens(prepared["megatron"].with_name("c.idx"), TokenDType.UINT16)
    assert tf.layout is Layout.MEGATRON and tf.data.name == "c.bin"
    raw = tf.index.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = np.frombuffer(raw[9:9 + 8], "<u8")[0], raw[17], \
        *np.frombuffer(raw[18:34], "<u8")
    docs = len(corpus.read_text().splitlines())
    assert (version, code, sequences, documents) == (1, 8, docs, docs + 1)
    lengths = np.frombuffer(raw[34:34 + 4 * docs], "<i4")
    pointers = np.frombuffer(raw[34 + 4 * docs:34 + 12 * docs], "<i8")
    doc_idx = np.frombuffer(raw[34 + 12 * docs:], "<i8")
    assert lengths.sum() == tf.num_tokens and pointers[1] == 2 * lengths[0]
    assert np.array_equal(doc_idx, np.arange(docs + 1))


@pytest.mark.parametrize("shuffle", [False, True])
def test_both_layouts_and_raw_ids_give_identical_batches(prepared, tmp_path, shuffle):
    raw = tmp_path / "c.u16"
    np.memmap(prepared["hetc"], dtype="<u2", mode="r", offset=HETC_OFFSET).tofile(raw)
    sources = [source(prepared["hetc"], shuffle), source(prepared["megatron"], shuffle),
               source(str(prepared["megatron"]) + ".bin", shuffle)]
    model = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=VOCAB, seq=SEQ)
    raw_data = DataSpec(kind=DataKind.TOKENS, path=str(raw), dtype=TokenDType.UINT16, shuffle=shuffle)
    sources.append(make_data_source(model, TrainSpec(global_batch=8, micro_batch=2, seed=5, data=raw_data)))
    for step, mb in [(0, 0), (3, 2), (1000, 1)]:
        first = sources[0].get_microbatch(step, mb)
        for other in sources[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, other.get_microbatch(step, mb), strict=True))


def test_unshuffled_sequence_g_is_tokens_g_seq_to_g_plus_one_seq(prepared):
    ids = np.memmap(prepared["hetc"], dtype="<u2", mode="r", offset=HETC_OFFSET)
    data = source(prepared["hetc"], shuffle=False)
    for step, mb in [(0, 0), (2, 3), (57, 1)]:
        tokens, labels = data.get_microbatch(step, mb)
        for i in range(2):
            g = step * 8 + mb * 2 + i
            window = torch.from_numpy(ids[g * SEQ:(g + 1) * SEQ + 1].astype(np.int64))
            assert torch.equal(tokens[i], window[:-1]) and torch.equal(labels[i], window[1:])


def test_shuffled_windows_are_each_visited_once_an_epoch(prepared):
    data = source(prepared["hetc"], shuffle=True)
    starts = [data.window_start(g) for g in range(data.num_windows)]
    assert sorted(starts) == [w * SEQ for w in range(data.num_windows)] and starts != sorted(starts)
    again = source(prepared["hetc"], shuffle=True)
    assert [again.window_start(g) for g in range(50)] == starts[:50]   # a function of (seed, g)


def test_eval_share_holds_out_the_last_windows(prepared):
    keys = {"eval_every": 1, "eval_share": 0.01}
    train = source(prepared["hetc"], False, **keys)
    model = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=VOCAB, seq=SEQ)
    spec = TrainSpec(global_batch=8, micro_batch=2, seed=5, **keys,
                     data=DataSpec(kind=DataKind.TOKENS, path=str(prepared["hetc"]), shuffle=False))
    held = make_eval_source(model, spec)
    whole = source(prepared["hetc"], False)
    kept = whole.num_windows - math.ceil(whole.num_windows * 0.01)
    assert train.num_windows == kept and held.num_windows == whole.num_windows - kept
    assert torch.equal(held.sequence(0), whole.sequence(kept))
    assert torch.equal(train.sequence(kept), whole.sequence(0))   # training wraps before the held-out windows


def test_prepared_tokens_train_end_to_end(prepared, tokenizer_dir, tmp_path):
    """Paths relative to the spec, which the plan directory rewrites relative to itself."""
    shutil.copy(prepared["hetc"], tmp_path / "corpus.tok")
    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    spec = tmp_path / "job.het"
    spec.write_text(f'''use "{DEMO.parent / 'catalog.het'}"
model tiny {{
  layers = 2
  hidden = 32
  heads = 2
  ffn = 64
  vocab = {VOCAB}
  seq = {SEQ}
  dtype = fp32
}}
cluster local {{
  node host {{
    device = cpu
  }}
}}
train {{
  global_batch = 4
  micro_batch = 2
  steps = 3
  eval_every = 3
  eval_share = 0.01
  data tokens {{
    path = "corpus.tok"
    dtype = uint16
    tokenizer = "tok"
  }}
}}
parallel {{
  stage all {{
    layers = embed..head
    ranks = host
    lanes = 1
  }}
}}
''')
    assert main(["check", str(spec)]) == 0
    assert main(["compile", str(spec), "-o", str(tmp_path / "plan")]) == 0
    plan = (tmp_path / "plan" / "plan.het").read_text()
    assert 'path = "../corpus.tok"' in plan and 'tokenizer = "../tok"' in plan
    metrics = tmp_path / "metrics.jsonl"
    assert main(["run", str(tmp_path / "plan"), "--local", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) == 3 and "val_loss" in records[-1]
    assert abs(records[0]["loss"] - math.log(VOCAB)) < 0.5, "random weights: about ln(vocab)"
    assert records[-1]["loss"] < records[0]["loss"]


def test_ids_beyond_the_model_are_refused(prepared, tokenizer_dir, tmp_path):
    from hetc.passes.data_check import check_data

    model = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=256, seq=SEQ)
    train = TrainSpec(global_batch=8, micro_batch=2, data=DataSpec(kind=DataKind.TOKENS, path=str(prepared["hetc"])))
    errors = []
    check_data(model, train, tmp_path, errors)
    assert [e.message for e in errors] == [(f"'{prepared['hetc']}' was written by the tokenizer "
                                            f"'{tokenizer_dir.name}' with a vocabulary of {VOCAB}, larger than "
                                            "the model's vocab = 256")]
    raw = tmp_path / "big.u16"   # a raw file says nothing of its vocabulary: a sample is checked at the start
    np.asarray([1, 2, 300, 4] * 10, dtype="<u2").tofile(raw)
    data = DataSpec(kind=DataKind.TOKENS, path=str(raw), dtype=TokenDType.UINT16, shuffle=False)
    beyond = "holds the id 300 at token 2, outside the model's vocab = 256"
    with pytest.raises(SpecError, match=beyond):
        make_data_source(model, TrainSpec(global_batch=2, micro_batch=2, data=data))
    windows = Windows(tokens=np.fromfile(raw, dtype="<u2"), vocab=256, where=f"'{raw}'", shuffle=False, seed=0,
                      seq=SEQ, micro_batch=2, global_batch=2)   # and every window its ids, beyond the sample
    with pytest.raises(DataError, match=beyond):
        windows.get_microbatch(0, 0)


def test_a_file_of_another_tokenizer_is_refused(prepared, tokenizer_dir, tmp_path):
    from hetc.passes.data_check import check_data

    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text() + "\n")
    model = ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=VOCAB, seq=SEQ)
    refused = (f"'{prepared['hetc']}' was written by the tokenizer '{tokenizer_dir.name}', not by '{other}' "
               "(their tokenizer.json differ)")
    for directory, want in [(tokenizer_dir, []), (other, [refused])]:
        data = DataSpec(kind=DataKind.TOKENS, path=str(prepared["hetc"]), tokenizer=str(directory))
        errors = []
        check_data(model, TrainSpec(global_batch=8, data=data), tmp_path, errors)
        assert [e.message for e in errors] == want


def test_a_vocabulary_beyond_uint16_needs_uint32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "doc.txt"
    text.write_text("w1 w69999 w65536\nw2\n")
    args = ["data", "prepare", str(text), "--tokenizer", str(tmp_path), "--eos", "w69998", "-o"]
    assert main([*args, str(tmp_path / "small"), "--dtype", "uint16"]) == 2
    assert "--dtype uint16 holds ids below 65536, but the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "small").exists()
    assert main([*args, str(tmp_path / "wide")]) == 0
    tf = inspect_tokens(tmp_path / "wide", TokenDType.UINT32)
    ids = np.memmap(tf.data, dtype=tf.dtype, mode="r", offset=tf.offset)
    assert (tf.dtype, tf.vocab, ids.tolist()) == ("uint32", 70_000, [1, 69999, 65536, 2, 69998])
    assert main([*args, str(tmp_path / "mega"), "--megatron"]) == 0
    assert inspect_tokens(tmp_path / "mega", TokenDType.UINT32).dtype == "int32"   # Megatron's code 4


def test_prepare_errors_exit_2(tokenizer_dir, corpus, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    cases = [
        ([str(bad)], "bad.jsonl:2: no text field 'text' (it has body)"),
        ([str(corpus), "--dtype", "uint16", "--eos", "nope"], "the EOS token 'nope' is not in the vocabulary"),
        ([str(tmp_path / "missing.jsonl")], "cannot find the input"),
        ([str(tmp_path / "t.parquet")], "cannot read the Parquet file"),
        # never opened: a pipe would block (Note [untrusted paths])
        ([str(tmp_path / "pipe.jsonl")], f"the input '{tmp_path / 'pipe.jsonl'}' is a named pipe, not a regular file"),
        ([str(tmp_path)], f"the input '{tmp_path}' is a directory, not a regular file"),
    ]
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    os.mkfifo(tmp_path / "pipe.jsonl")
    for args, message in cases:
        status = main(["data", "prepare", *args, "--tokenizer", str(tokenizer_dir), "-o", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert status == 2 and message in err, (args, err)
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tmp_path), "-o", str(tmp_path / "o")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_parquet_gives_the_tokens_json_lines_give(prepared, corpus, tokenizer_dir, tmp_path, capsys):
    """The same documents as a Parquet column, read a batch of rows at a time, make the same file."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the test extra; `make test` installs it")
    import pyarrow as pa

    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    table = pa.table({"id": [r["id"] for r in rows], "body": [r["text"] for r in rows]})
    pq.write_table(table, tmp_path / "corpus.parquet", row_group_size=500)
    out = tmp_path / "p.tok"
    args = ["data", "prepare", str(tmp_path / "corpus.parquet"), "--tokenizer", str(tokenizer_dir), "-o"]
    assert main([*args, str(out), "--field", "body"]) == 0
    assert out.read_bytes() == prepared["hetc"].read_bytes()
    assert main([*args, str(tmp_path / "q.tok")]) == 2
    assert "no column 'text' (it has id, body); choose it with --field NAME" in capsys.readouterr().err


def test_a_document_that_is_not_text_is_named_where(tokenizer_dir, tmp_path, capsys):
    """A JSON value or Parquet column the tokenizer cannot take (a number, a list, bytes, a lone surrogate
    that JSON's \\ud800 escape can name) is a usage error at its file and line, not a TypeError."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the test extra; `make test` installs it")
    import pyarrow as pa

    (tmp_path / "number.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    (tmp_path / "null.jsonl").write_text('{"text": null}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "a\\ud800b"}\n')
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": [b"a", b"b"]}), tmp_path / "bytes.parquet")
    cases = {
        "number.jsonl": "number.jsonl:2: the field 'text' holds int, not text",
        "null.jsonl": "null.jsonl:1: the field 'text' holds null, not text",
        "surrogate.jsonl": "surrogate.jsonl:1: the field 'text' holds a lone surrogate ('\\ud800') at character 1",
        "ints.parquet": "ints.parquet: the column 'text' holds int64, not text",
        "bytes.parquet": "bytes.parquet: the column 'text' holds binary, not text",
    }
    for name, message in cases.items():
        status = main(["data", "prepare", str(tmp_path / name), "--tokenizer", str(tokenizer_dir),
                       "-o", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert status == 2 and message in err, (name, err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("eos", [99999, -5, True])
def test_a_configured_eos_id_outside_the_vocabulary_is_refused(tokenizer_dir, tmp_path, capsys, eos):
    """An eos_token_id in config.json beyond the vocabulary (or below 0) would be written after every
    document, where no model can embed it; `true` is not an id."""
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    (tmp_path / "doc.txt").write_text("hello")
    status = main(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", str(tmp_path),
                   "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == 2 and ("not in the vocabulary" in err or "names no EOS token" in err), err
    assert not (tmp_path / "o").exists()


def test_parquet_without_pyarrow_says_what_to_install(tokenizer_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)   # `import pyarrow.parquet` now fails
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    assert main(["data", "prepare", str(tmp_path / "t.parquet"), "--tokenizer", str(tokenizer_dir),
                 "-o", str(tmp_path / "o")]) == 2
    assert "needs pyarrow: pip install pyarrow" in capsys.readouterr().err


def test_megatron_files_hetc_cannot_read_as_one_stream_are_refused(prepared, tmp_path):
    from hetc.ir.tokenfile import TokenFileError

    idx = prepared["megatron"].with_name("c.idx").read_bytes()
    shutil.copy(prepared["megatron"].with_name("c.bin"), tmp_path / "m.bin")

    def broken(raw: bytes, match: str) -> None:
        (tmp_path / "m.idx").write_bytes(raw)
        with pytest.raises(TokenFileError, match=match):
            inspect_tokens(tmp_path / "m", None)

    broken(idx[:17] + bytes([5]) + idx[18:], r"stores int64 ids; hetc reads uint16 \(code 8\) and int32")
    broken(idx[:9] + (2).to_bytes(8, "little") + idx[17:], "version 2 of Megatron's index")
    broken(b"NOTMEGA" + idx[7:], "is not a Megatron index")
    with pytest.raises(TokenFileError, match="dtype = uint32, but .* says its ids are uint16"):
        (tmp_path / "m.idx").write_bytes(idx)
        inspect_tokens(tmp_path / "m", TokenDType.UINT32)
    second = 34 + 4 * int.from_bytes(idx[18:26], "little") + 8   # where sequence 1's byte offset is
    later = (int.from_bytes(idx[second:second + 8], "little") + 2).to_bytes(8, "little")
    (tmp_path / "m.idx").write_bytes(idx[:second] + later + idx[second + 8:])   # a gap before sequence 1
    with pytest.raises(SpecError, match="do not lie back to back"):
        source(tmp_path / "m", shuffle=False)
