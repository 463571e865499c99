"""The built-in data's reading side (autopar/sections/data.py): every format gives the packed
samples a hand computation gives, a tokenizer.json gives the ids `tokenizers` gives, a corpus is
tokenized once and memory-mapped after, and every refusal names the file and a fix and writes nothing."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle

import numpy as np
import pytest

from autopar import config as autopar_config
from autopar.sections import data
from autopar.sections.data import (DataConfig, DataError, PackedSequences, data_splits, fingerprint,
                                           tokens_of, vocab_size)
from autopar.errors import ConfigError

DOCS = ["first doc", "second, ünïcode", "x"]


def byte_stream(documents: list[str]) -> list[int]:
    """The bytes tokenizer by hand: each document's UTF-8 bytes, then 256."""
    ids: list[int] = []
    for doc in documents:
        ids += list(doc.encode("utf-8")) + [256]
    return ids


def samples(dataset: PackedSequences) -> list[tuple[list[int], list[int]]]:
    return [(x.tolist(), y.tolist()) for x, y in (dataset[i] for i in range(len(dataset)))]


def packed(ids: list[int], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Sequences of seq_len + 1 tokens with stride seq_len, the last partial one dropped."""
    count = (len(ids) - 1) // seq_len
    return [(ids[i * seq_len:(i + 1) * seq_len], ids[i * seq_len + 1:(i + 1) * seq_len + 1]) for i in range(count)]


def test_a_txt_file_packs_as_worked_by_hand(tmp_path):
    (tmp_path / "a.txt").write_text("abcde")
    train, val = data_splits(DataConfig(path=str(tmp_path / "a.txt"), seq_len=2), min_samples=1)
    # ids 97 98 99 100 101 256: two samples of 2, the last token (256) predicted by the second.
    assert samples(train) == [([97, 98], [98, 99]), ([99, 100], [100, 101])]
    assert val is None
    assert packed(byte_stream(["abcde"]), 2) == samples(train)
    x, y = train[-1]
    assert x.dtype == y.dtype == __import__("torch").int64 and x.tolist() == [99, 100]
    with pytest.raises(IndexError):
        train[2]


def _write_txt_folder(root, documents):
    root.mkdir()
    for i, doc in enumerate(documents):
        (root / f"{i:02d}.py").write_text(doc)


def _write_jsonl(path, documents):
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents)) + "\n")


def _write_parquet(path, documents):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(documents))), "text": documents}), path, row_group_size=1)


def _write_shards(root, documents, writer, suffix):
    root.mkdir()
    for i, doc in enumerate(documents):
        writer(root / f"part-{i:03d}{suffix}", [doc])


def _write_datasets(root, documents):
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": documents, "n": list(range(len(documents)))}).save_to_disk(str(root))


FORMATS = {
    "txt folder": lambda p: (_write_txt_folder(p / "src", DOCS), p / "src")[1],
    "jsonl": lambda p: (_write_jsonl(p / "c.jsonl", DOCS), p / "c.jsonl")[1],
    "jsonl shards": lambda p: (_write_shards(p / "js", DOCS, _write_jsonl, ".jsonl"), p / "js")[1],
    "parquet": lambda p: (_write_parquet(p / "c.parquet", DOCS), p / "c.parquet")[1],
    "parquet shards": lambda p: (_write_shards(p / "pq", DOCS, _write_parquet, ".parquet"), p / "pq")[1],
    "datasets folder": lambda p: (_write_datasets(p / "ds", DOCS), p / "ds")[1],
    "bin uint16": lambda p: (np.array(byte_stream(DOCS), np.uint16).tofile(p / "t.bin"), p / "t.bin")[1],
    "bin uint32": lambda p: (np.array(byte_stream(DOCS), np.uint32).tofile(p / "t.u32.bin"), p / "t.u32.bin")[1],
}


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_every_format_round_trips(kind, tmp_path):
    path = FORMATS[kind](tmp_path)
    config = DataConfig(path=str(path), seq_len=5, cache_dir=str(tmp_path / "cache"))
    expected = byte_stream(DOCS)
    assert tokens_of(str(path), config).tolist() == expected
    train, _ = data_splits(config, min_samples=1)
    assert samples(train) == packed(expected, 5)
    cached = list((tmp_path / "cache").glob("tokens-*.bin")) if (tmp_path / "cache").exists() else []
    assert len(cached) == (0 if kind.startswith("bin") else 1)  # a .bin is read as it is


def test_a_text_folder_is_read_in_path_order_skipping_hidden_files_and_bytecode(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "b.py").write_text("B")
    (root / "a.py").write_text("A")
    (root / "sub" / "c.py").write_bytes(b"C\xff")  # not UTF-8: U+FFFD, whose UTF-8 is EF BF BD
    (root / ".hidden").write_text("H")
    (root / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\x00\x01")
    ids = tokens_of(str(root), DataConfig(path=str(root)))
    assert ids.tolist() == [65, 256, 66, 256, 67, 0xEF, 0xBF, 0xBD, 256]


def _tokenizer_json(tmp_path, eos="<|endoftext|>", truncate=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]"] + ([eos] if eos else [])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 5,
                                  trainer)
    if truncate:
        tokenizer.enable_truncation(truncate)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path, Tokenizer.from_file(str(path))


def test_a_tokenizer_json_gives_the_ids_tokenizers_gives(tmp_path):
    path, reference = _tokenizer_json(tmp_path, truncate=3)  # a saved truncation must not cut documents
    reference.no_truncation()
    documents = ["the cat sat on the mat and the dog sat on the log", "a cat", "the mat the log the cat"]
    _write_jsonl(tmp_path / "c.jsonl", documents)
    config = DataConfig(path=str(tmp_path / "c.jsonl"), tokenizer=str(path), seq_len=4)
    eod = reference.token_to_id("<|endoftext|>")
    expected = []
    for doc in documents:
        expected += reference.encode(doc, add_special_tokens=False).ids + [eod]
    assert len(expected) > 3 * len(documents) + 3
    assert tokens_of(config.path, config).tolist() == expected
    assert vocab_size(config) == reference.get_vocab_size(with_added_tokens=True)
    assert vocab_size(DataConfig(tokenizer=str(tmp_path))) == vocab_size(config)  # its folder names it too
    assert samples(data_splits(config, 1)[0]) == packed(expected, 4)


def test_a_tokenizer_without_an_end_of_document_token_needs_one_named(tmp_path):
    path, reference = _tokenizer_json(tmp_path, eos=None)
    (tmp_path / "a.txt").write_text("the cat")
    config = DataConfig(path=str(tmp_path / "a.txt"), tokenizer=str(path))
    with pytest.raises(DataError, match="eod_token") as refused:
        tokens_of(config.path, config)
    assert str(path) in str(refused.value)
    ids = tokens_of(config.path, dataclasses.replace(config, eod_token=0))
    assert ids.tolist() == reference.encode("the cat").ids + [0]


def test_a_cached_corpus_is_memory_mapped_and_not_tokenized_again(tmp_path, monkeypatch):
    _write_jsonl(tmp_path / "c.jsonl", DOCS)
    config = DataConfig(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"), seq_len=4)
    first = tokens_of(config.path, config)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    name = f"tokens-{fingerprint(config, config.path)}"
    assert files == [f"{name}.bin", f"{name}.json"]
    sidecar = json.loads((tmp_path / "cache" / files[1]).read_text())
    assert (sidecar["dtype"], sidecar["count"], sidecar["documents"]) == ("uint16", len(byte_stream(DOCS)), 3)

    def no_reading(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "_documents", no_reading)
    again = tokens_of(config.path, config)
    assert isinstance(again, np.memmap) and again.tolist() == first.tolist() == byte_stream(DOCS)
    assert samples(data_splits(config, 1)[0]) == packed(byte_stream(DOCS), 4)
    monkeypatch.undo()

    _write_jsonl(tmp_path / "c.jsonl", DOCS + ["more"])  # a changed file is another corpus
    assert tokens_of(config.path, config).tolist() == byte_stream(DOCS + ["more"])
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2


def test_a_cache_file_its_sidecar_does_not_vouch_for_is_never_read(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    config = DataConfig(path=str(tmp_path / "a.txt"), cache_dir=str(tmp_path / "cache"))
    tokens_of(config.path, config)
    cached = next((tmp_path / "cache").glob("*.bin"))
    with open(cached, "r+b") as f:  # as if a writer had been killed half-way
        f.truncate(6)
    assert tokens_of(config.path, config).tolist() == byte_stream(["hello world"])
    cached.with_suffix(".json").unlink()  # a .bin renamed in, its sidecar not yet
    assert tokens_of(config.path, config).tolist() == byte_stream(["hello world"])
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]  # no temporary left


def test_callers_racing_on_one_cache_all_read_whole_corpora(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    documents = [f"document {i} " * 50 for i in range(400)]
    _write_jsonl(tmp_path / "c.jsonl", documents)
    config = DataConfig(path=str(tmp_path / "c.jsonl"), cache_dir=str(tmp_path / "cache"))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: tokens_of(config.path, config).tolist(), range(4)))
    assert all(result == byte_stream(documents) for result in results)
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]


def test_val_fraction_holds_out_the_end_at_a_sequence_boundary(tmp_path):
    text = "abcdefghijklmnopqrstuvwxyz" * 3  # 78 bytes + end-of-document: 79 tokens, 19 sequences of 4
    (tmp_path / "a.txt").write_text(text)
    ids = byte_stream([text])
    train, val = data_splits(DataConfig(path=str(tmp_path / "a.txt"), seq_len=4, val_fraction=0.2), min_samples=3)
    assert (len(train), len(val)) == (16, 3)  # int(19 * 0.2) = 3 held out
    assert samples(train) + samples(val) == packed(ids, 4)  # every token predicted once, none twice
    assert samples(val)[0][0] == ids[64:68]


def test_val_path_is_its_own_corpus(tmp_path):
    (tmp_path / "t.txt").write_text("training text")
    (tmp_path / "v.txt").write_text("held out")
    config = DataConfig(path=str(tmp_path / "t.txt"), val_path=str(tmp_path / "v.txt"), seq_len=3,
                        cache_dir=str(tmp_path / "cache"))
    train, val = data_splits(config, min_samples=2)
    assert samples(train) == packed(byte_stream(["training text"]), 3)
    assert samples(val) == packed(byte_stream(["held out"]), 3)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2


def test_a_memory_mapped_dataset_pickles_by_file_name(tmp_path):
    np.arange(100_000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    train, _ = data_splits(DataConfig(path=str(tmp_path / "t.bin"), seq_len=64), min_samples=1)
    blob = pickle.dumps(train)
    assert len(blob) < 2_000  # not the 200 kB corpus
    copy = pickle.loads(blob)
    assert samples(copy)[-1] == samples(train)[-1] and len(copy) == len(train) == (100_000 - 1) // 64


def test_fingerprint_names_the_files_tokenizer_and_length(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    config = DataConfig(path=str(tmp_path / "a.txt"), seq_len=8)
    whole, corpus = fingerprint(config), fingerprint(config, config.path)
    assert fingerprint(dataclasses.replace(config, seq_len=16)) != whole
    assert fingerprint(dataclasses.replace(config, seq_len=16), config.path) == corpus  # same tokens serve both
    assert fingerprint(dataclasses.replace(config, eod_token=0), config.path) != corpus
    os.utime(tmp_path / "a.txt", ns=(1, 1))
    assert fingerprint(config, config.path) != corpus


# Each refusal: (set up the files, give the config, and what the message must name).
def _missing(p):
    return DataConfig(path=str(p / "nope.txt"), seq_len=4), "nope.txt"


def _empty(p):
    (p / "e.txt").write_text("")
    return DataConfig(path=str(p / "e.txt"), seq_len=4), "e.txt"


def _csv(p):
    (p / "c.csv").write_text("text\nhello\n")
    return DataConfig(path=str(p / "c.csv"), seq_len=4), "c.csv"


def _bad_line(p):
    (p / "c.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    return DataConfig(path=str(p / "c.jsonl"), seq_len=1), "line 2"


def _no_field(p):
    (p / "c.jsonl").write_text('{"text": "fine"}\n{"body": "x"}\n')
    return DataConfig(path=str(p / "c.jsonl"), seq_len=1), "line 2"


def _too_short(p):
    (p / "a.txt").write_text("abcdefgh")  # 9 tokens: 2 sequences of 4
    return DataConfig(path=str(p / "a.txt"), seq_len=4), "a.txt"


def _val_too_short(p):
    (p / "a.txt").write_text("abcdefgh" * 10)
    (p / "v.txt").write_text("abcd")
    return DataConfig(path=str(p / "a.txt"), val_path=str(p / "v.txt"), seq_len=4), "v.txt"


def _val_missing(p):
    (p / "a.txt").write_text("abcdefgh" * 10)
    return DataConfig(path=str(p / "a.txt"), val_path=str(p / "v.txt"), seq_len=4), "v.txt"


def _fraction_too_large(p):
    (p / "a.txt").write_text("abcdefgh" * 10)
    return DataConfig(path=str(p / "a.txt"), val_fraction=0.5, seq_len=4), "a.txt"


def _fraction_too_small(p):
    (p / "a.txt").write_text("abcdefgh" * 10)  # 81 tokens: 20 sequences, 0.1 of them is 2
    return DataConfig(path=str(p / "a.txt"), val_fraction=0.1, seq_len=4), "a.txt"


def _hub_id(p):
    return DataConfig(path="roneneldan/TinyStories", seq_len=4), "downloaded"


def _dataset_dict(p):
    import datasets

    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"text": ["a b c"] * 4})
    datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(str(p / "dd"))
    return DataConfig(path=str(p / "dd"), seq_len=4), "validation"


def _mixed_folder(p):
    (p / "m").mkdir()
    (p / "m" / "a.jsonl").write_text('{"text": "x"}\n')
    (p / "m" / "b.txt").write_text("y")
    return DataConfig(path=str(p / "m"), seq_len=1), "m"


def _binary_in_text_folder(p):
    (p / "f").mkdir()
    (p / "f" / "a.py").write_text("fine " * 20)
    (p / "f" / "z.png").write_bytes(b"\x89PNG\x00\x00")
    return DataConfig(path=str(p / "f"), seq_len=1), "z.png"


def _remote_tokenizer(p):
    (p / "a.txt").write_text("abcdefgh" * 10)
    return DataConfig(path=str(p / "a.txt"), tokenizer="gpt2", seq_len=4), "gpt2"


REFUSALS = [_missing, _empty, _csv, _bad_line, _no_field, _too_short, _val_too_short, _val_missing,
            _fraction_too_large, _fraction_too_small, _hub_id, _dataset_dict, _mixed_folder, _binary_in_text_folder,
            _remote_tokenizer]


@pytest.mark.parametrize("case", REFUSALS, ids=[f.__name__.strip("_") for f in REFUSALS])
def test_each_refusal_names_the_file_and_a_fix_and_writes_nothing(case, tmp_path):
    config, named = case(tmp_path)
    cache = tmp_path / "run" / "cache"
    with pytest.raises(DataError) as refused:
        data_splits(dataclasses.replace(config, cache_dir=str(cache)), min_samples=4)
    message = str(refused.value)
    assert named in message and "Fix:" in message and "\n" not in message
    assert not (tmp_path / "run").exists()  # not even the cache folder


def test_the_data_group_composes_and_refuses_what_cannot_work(tmp_path):
    cfg = autopar_config.compose_config([f"data.path={tmp_path}/c.jsonl", "data.val_fraction=0.01",
                                         "data.seq_len=128"])
    assert (cfg.data.path, cfg.data.val_fraction, cfg.data.seq_len, cfg.data.tokenizer) == \
        (f"{tmp_path}/c.jsonl", 0.01, 128, "bytes")
    path, _ = _tokenizer_json(tmp_path)
    assert autopar_config.compose_config([f"data.tokenizer={path}"]).data.tokenizer == str(path)
    for bad, named in (("data.val_fraction=0.5", "val_fraction"), ("data.num_workers=-1", "num_workers"),
                       ("data.seq_len=0", "seq_len"), ("data.tokenizer=gpt2", "tokenizer"),
                       ("data.bin_dtype=int8", "bin_dtype")):
        with pytest.raises(ConfigError, match=named):
            autopar_config.compose_config([bad])


def test_the_config_schema_and_the_runtime_dataclass_agree():
    from tests.unit.test_conf import _undocumented

    schema = [(f.name, f.default) for f in dataclasses.fields(autopar_config.DataConfig)]
    runtime = [(f.name, f.default) for f in dataclasses.fields(DataConfig)]
    assert schema == runtime
    assert _undocumented(autopar_config.DataConfig) == [] and _undocumented(DataConfig) == []
