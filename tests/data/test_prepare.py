"""`muloco data prepare`: text, JSONL and Parquet in; byte or BPE token files and meta.json out; determinism
and one-line errors; `data.source: tokens` reads the result without data.vocab_size."""

import json

import numpy as np
import pytest

from muloco.config import DataConfig
from muloco.data import load_data
from muloco.data.prepare import prepare
from muloco.data.tokenizer import ByteTokenizer, load_bpe
from muloco.errors import DataError, UserError

DOCS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # doc {i}\n" * (1 + i % 3) for i in range(60)]


@pytest.fixture
def corpus(tmp_path):
    """The same 60 documents as text files, JSONL lines and Parquet rows."""
    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(DOCS):
        (text / f"doc{i:02d}.py").write_text(doc)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return {"text": text, "jsonl": jsonl, "root": tmp_path}


def _tokens(out, split):
    meta = json.loads((out / "meta.json").read_text())
    return np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]), meta


def test_byte_tokens_are_the_utf8_bytes_with_an_eot_after_each_document(corpus, tmp_path):
    out = tmp_path / "byte"
    meta = prepare([str(corpus["text"])], str(out), "byte", val_fraction=0.2)
    train, _ = _tokens(out, "train")
    val, _ = _tokens(out, "val")
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "byte" and meta["eot_token"] == 0
    counts = meta["counts"]
    assert counts["documents"] == 60 and counts["train_documents"] + counts["val_documents"] == 60
    assert 0 < counts["val_documents"] < 60 and meta["split"]["by"] == "document hash"
    assert len(train) + len(val) == sum(len(d.encode()) + 1 for d in DOCS)  # every byte, one EOT each
    assert (train == 0).sum() == counts["train_documents"]
    assert not (out / "tokenizer.json").exists()


def test_bpe_is_deterministic_and_round_trips(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    meta = prepare([str(corpus["text"])], str(a), "bpe:300")
    prepare([str(corpus["text"])], str(b), "bpe:300")
    for name in ("train.bin", "val.bin", "meta.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    tokenizer = load_bpe(a / "tokenizer.json")
    assert meta["vocab_size"] == tokenizer.vocab_size == 300 and meta["dtype"] == "uint16"
    train, _ = _tokens(a, "train")
    assert len(train) < sum(len(d.encode()) for d in DOCS) / 2  # merges compress the bytes
    first = train[: list(train).index(tokenizer.eot)]
    assert tokenizer.decode(first.tolist()) in DOCS


def test_jsonl_field_and_parquet_column_give_the_same_documents_as_text_files(corpus, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parquet = corpus["root"] / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS, "n": list(range(60))}), parquet)
    for source, options in ((corpus["jsonl"], {"text_field": "body"}), (parquet, {"column": "content"})):
        out = tmp_path / source.suffix[1:]
        meta = prepare([str(source)], str(out), "byte", **options)
        train, _ = _tokens(out, "train")
        val, _ = _tokens(out, "val")
        assert meta["counts"]["documents"] == 60
        assert len(train) + len(val) == sum(len(d.encode()) + 1 for d in DOCS)


def test_one_document_is_split_by_tokens(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("hello world " * 200)
    meta = prepare([str(one)], str(tmp_path / "out"), "byte", val_fraction=0.1)
    assert meta["split"]["by"].startswith("tokens")
    assert meta["counts"]["val_tokens"] == round(2401 * 0.1) and meta["counts"]["train_tokens"] == 2401 - 240


def test_tokens_source_reads_meta_json_and_checks_the_config_against_it(corpus, tmp_path):
    out = tmp_path / "bpe"
    prepare([str(corpus["text"])], str(out), "bpe:280")
    data = load_data(DataConfig(source="tokens", path=str(out)), seq_len=16)
    assert data.vocab_size == 280 and data.tokenizer_file == out / "tokenizer.json"
    with pytest.raises(DataError, match="data.dtype=uint32 but .*meta.json says uint16"):
        load_data(DataConfig(source="tokens", path=str(out), dtype="uint32"), seq_len=16)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid meta.json"):
        load_data(DataConfig(source="tokens", path=str(out)), seq_len=16)


def test_a_padded_vocabulary_is_allowed_a_smaller_one_is_not(corpus, tmp_path):
    out = tmp_path / "bytes"
    prepare([str(corpus["text"])], str(out), "byte")
    assert load_data(DataConfig(source="tokens", path=str(out), vocab_size=320), seq_len=16).vocab_size == 320
    with pytest.raises(DataError, match="data.vocab_size=200 but .*says 256; set it >= 256"):
        load_data(DataConfig(source="tokens", path=str(out), vocab_size=200), seq_len=16)


def test_tokens_without_meta_json_still_need_the_vocab_size(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(d / f"{split}.bin")
    with pytest.raises(DataError, match="data.vocab_size is required"):
        load_data(DataConfig(source="tokens", path=str(d)), seq_len=16)
    data = load_data(DataConfig(source="tokens", path=str(d), vocab_size=100), seq_len=16)
    assert data.vocab_size == 100 and data.tokenizer == "unknown"  # samples of such a run are refused


@pytest.mark.parametrize(
    "make, spec, needles",
    [
        (lambda d: (d / "e.txt").write_text(""), "byte", ["holds no text"]),
        (lambda d: (d / "b.bin").write_bytes(b"\x00\x01\x02" * 10), "byte", ["b.bin", "binary"]),
        (lambda d: (d / "l.txt").write_bytes(b"caf\xe9"), "byte", ["l.txt", "not UTF-8"]),
        (lambda d: (d / "j.jsonl").write_text('{"text": "a"}\nnot json\n'), "byte", ["j.jsonl", "line 2"]),
        (lambda d: (d / "k.jsonl").write_text('{"body": "a"}\n'), "byte", ["k.jsonl", "--field"]),
        (lambda d: (d / "t.txt").write_text("x"), "bpe:100", ["--tokenizer", "at least 257"]),
        (lambda d: (d / "t.txt").write_text("x"), "words", ["--tokenizer", "bpe:VOCAB"]),
    ],
)
def test_bad_inputs_are_one_line_errors(tmp_path, make, spec, needles):
    src = tmp_path / "src"
    src.mkdir()
    make(src)
    with pytest.raises(UserError) as info:
        prepare([str(src)], str(tmp_path / "out"), spec)
    assert "\n" not in str(info.value) and all(n in str(info.value) for n in needles), str(info.value)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_unreadable_input_and_a_non_empty_out_are_refused(tmp_path):
    missing = tmp_path / "nothing*.txt"
    with pytest.raises(DataError, match="INPUT: .* matches no files"):
        prepare([str(missing)], str(tmp_path / "out"))
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("x")
    with pytest.raises(UserError, match="--out .* is a file"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "a.txt"))
    with pytest.raises(DataError, match="makes 10 tokens; give at least 16"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "short"))
    (tmp_path / "a.txt").write_text("some text, long enough to split")
    with pytest.raises(UserError, match="--out .* not empty"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "busy"))
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "busy"), force=True)
    assert not (tmp_path / "busy" / "keep").exists() and (tmp_path / "busy" / "meta.json").exists()


def test_byte_tokenizer_decodes_what_it_encodes():
    tok = ByteTokenizer()
    text = "naïve café ✓"
    assert tok.decode(tok.encode_batch([text])[0]) == text
