"""Built-in language-model data: a user's text files turned into packed token sequences.

What ``data.path`` (and ``data.val_path``) may name is decided by the suffix or by what the
folder holds, never by guessing from the text itself:
    FILE.txt            one document: the whole file (UTF-8; bytes that are not become U+FFFD)
    FILE.jsonl          one JSON object a line, its ``text_field`` one document
    FILE.parquet        the column ``text_field``, a batch of rows at a time (pyarrow)
    FILE.bin            token ids already made, as nanoGPT's prepare.py writes them: uint16, or uint32
                        where the name ends ``.u32.bin`` or ``bin_dtype`` is uint32; read as they are
    DIR/ with state.json or dataset_info.json   a ``datasets.Dataset.save_to_disk`` folder, column ``text_field``
    DIR/ of .jsonl files only, or of .parquet files only      shards, read in name order
    DIR/ of any other files   every file one document (UTF-8), in order of relative path, sub-folders
                        included; names starting with "." and __pycache__ folders are skipped, and a
                        binary file (one holding a NUL byte) is refused
Nothing is ever downloaded: a name that is not on this machine is refused.

Tokenizers: ``bytes`` (UTF-8 bytes are ids 0..255, end-of-document 256: vocabulary 257) or a local
tokenizer.json (Hugging Face ``tokenizers``; encoded without the post-processor's special tokens).

Packing: the documents are joined with the end-of-document id after each, and the stream is cut
into sequences of seq_len + 1 tokens with stride seq_len (the last partial one dropped), so every
token but the first is predicted exactly once. Sample i is tokens[i*L : i*L + L + 1]: inputs are
its first L, targets its last L.

Caching: a corpus is tokenized once, in chunks, into ``cache_dir/tokens-<fingerprint>.bin`` (+ a
json sidecar with its dtype and count) and memory-mapped from then on. The .bin is written under a
temporary name and renamed, then the sidecar likewise: a reader trusts a .bin only through its
sidecar, so however many ranks call at once none reads a half-written file (at worst two write
the same bytes). A refusal leaves nothing behind.

    train, val = data_splits(DataConfig(path="corpus/", seq_len=256, cache_dir="run/"), min_samples=32)
    inputs, targets = train[0]          # two int64 tensors of 256 tokens, targets shifted by one
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

BYTES_TOKENIZER = "bytes"
BYTES_VOCAB = 257
BYTES_EOD = 256
# Special tokens taken as end-of-document, in order of preference (GPT-2/NeoX, Llama/T5, others).
EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>")
# Text handed to the tokenizer at once: bounds the memory tokenizing takes (one document is whole).
_CHUNK_CHARS = 4 << 20
_CHUNK_DOCS = 2048
_PARQUET_ROWS = 1024
_CACHE_VERSION = 1
# Suffixes that name a format: a folder mixing them with other files is refused, not guessed.
_FORMAT_SUFFIXES = (".jsonl", ".parquet", ".bin", ".arrow")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FORMATS_FIX = ("give a .txt file (one document), a .jsonl file (one JSON object a line), a .parquet file, a .bin "
                "file of token ids, a folder of text files, or a folder written by datasets' save_to_disk")


@dataclass(frozen=True)
class DataConfig:
    """Where the training text is and how it becomes token sequences (the ``data`` config group)."""

    path: str | None = None
    """A file or folder of training text (formats above); None: no built-in data."""
    val_path: str | None = None
    """A file or folder of validation text; None: ``val_fraction`` of ``path``, or no validation."""
    val_fraction: float = 0.0
    """Share of ``path``'s sequences, taken from its end, held out for validation ([0, 0.5))."""
    tokenizer: str = BYTES_TOKENIZER
    """``bytes`` (vocabulary 257, end-of-document 256), or a local tokenizer.json (or its folder)."""
    seq_len: int | None = None
    """Tokens per sample; None: the sequence length the plan was traced with."""
    text_field: str = "text"
    """The field of each .jsonl object, or the column of a .parquet file or datasets folder, holding the text."""
    eod_token: int | None = None
    """Id appended after every document; None: 256 for bytes, else the tokenizer's end-of-text special token."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0: load in the training process)."""
    cache_dir: str | None = None
    """Folder the tokenized corpora are cached in (None: tokenize in memory at every start)."""
    bin_dtype: str = "uint16"
    """Token dtype of a .bin file (uint16 or uint32; a name ending .u32.bin is read as uint32)."""


class DataError(ValueError):
    """The data cannot be read as given; the message is one paragraph naming the file, the problem and the fix."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} Fix: {fix}")


class PackedSequences(Dataset):
    """Map-style dataset over a token stream: sample i is (tokens[a : a+L], tokens[a+1 : a+L+1]) with
    a = start + i*L, as int64 tensors; the same i always gives the same sample.

    A memory-mapped stream is pickled as its file's name (DataLoader workers under spawn reopen it
    instead of receiving a copy of the corpus).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, stop: int | None = None):
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, not {seq_len}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.start = int(start)
        self.stop = len(tokens) if stop is None else int(stop)

    def __len__(self) -> int:
        return max(0, (self.stop - self.start - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(self)
        i = int(index) + count if int(index) < 0 else int(index)
        if not 0 <= i < count:
            raise IndexError(f"sample {index} of {count}")
        begin = self.start + i * self.seq_len
        chunk = torch.from_numpy(np.asarray(self.tokens[begin:begin + self.seq_len + 1]).astype(np.int64))
        return chunk[:-1], chunk[1:].clone()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        mapped = _mapped_file(self.tokens)
        if mapped is not None:
            state["tokens"] = mapped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], _MappedFile):
            state["tokens"] = state["tokens"].open()
        self.__dict__.update(state)


@dataclass(frozen=True)
class _MappedFile:
    """A whole-file token memmap, by name."""

    path: str
    dtype: str
    count: int

    def open(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=(self.count,))


def _mapped_file(tokens: np.ndarray) -> _MappedFile | None:
    """The file behind a memmap of a whole file (a slice's offset is not recorded, so it pickles as an array)."""
    name = getattr(tokens, "filename", None)
    if not isinstance(tokens, np.memmap) or not name or tokens.offset:
        return None
    if not os.path.isfile(name) or os.path.getsize(name) != tokens.size * tokens.itemsize:
        return None
    return _MappedFile(str(name), tokens.dtype.str, int(tokens.size))


# ---------------------------------------------------------------------------------------------
# Public entry points


def tokens_of(path: str, config: DataConfig) -> np.ndarray:
    """The whole file or folder tokenized, each document followed by the end-of-document id:
    uint16 (uint32 past 65,536 ids), memory-mapped when cached or a .bin. Raises DataError."""
    role = _role(path, config)
    source = _source(path, config, role)
    tokenizer = None if source.kind == "bin" else _tokenizer(config)
    return _commit_all([_build(source, tokenizer, config, role)])[0]


def data_splits(config: DataConfig, min_samples: int) -> tuple[PackedSequences, PackedSequences | None]:
    """Training and validation datasets of ``config``; validation is None without val_path or val_fraction.

    Everything is checked before anything is written: missing or empty files, unknown formats,
    and train or validation holding fewer than ``min_samples`` sequences (one global batch) are
    refused with a DataError and the cache is left as it was.
    """
    seq_len = _seq_len(config)
    _check_split_settings(config)
    sources = [("data.path", _source(config.path, config, "data.path"))]
    if config.val_path is not None:
        sources.append(("data.val_path", _source(config.val_path, config, "data.val_path")))
    tokenizer = _tokenizer(config) if any(source.kind != "bin" for _, source in sources) else None
    pending: list[_Pending] = []
    try:
        for role, source in sources:
            pending.append(_build(source, tokenizer, config, role))
        cuts = _split_points(config, sources, [p.count for p in pending], seq_len, min_samples)
    except BaseException:
        for item in reversed(pending):  # the last made shares the first's folder: it goes first
            item.discard()
        raise
    arrays = _commit_all(pending)
    (train_stop, val_range) = cuts
    train = PackedSequences(arrays[0], seq_len, 0, train_stop)
    if val_range is None:
        return train, None
    val_tokens = arrays[1] if len(arrays) > 1 else arrays[0]
    return train, PackedSequences(val_tokens, seq_len, *val_range)


def vocab_size(config: DataConfig) -> int:
    """Ids the tokenizer can produce: 257 for bytes, the tokenizer.json's vocabulary with its added tokens."""
    return _tokenizer(config).vocab_size


def fingerprint(config: DataConfig, path: str | None = None) -> str:
    """sha256 naming data: with ``path``, that corpus as tokenized (its files' names, sizes and
    mtime_ns, the tokenizer's bytes, the end-of-document id, the field read), which names its
    cache file; without, the whole setup (train and validation corpora, val_fraction, seq_len),
    which a resumed run can compare. The sequence length is left out of a corpus's name: the same
    tokens serve every length."""
    if path is not None:
        return _corpus_fingerprint(_source(path, config, _role(path, config)), config)
    parts = {"version": _CACHE_VERSION, "val_fraction": config.val_fraction, "seq_len": config.seq_len,
             "path": fingerprint(config, config.path) if config.path is not None else None,
             "val_path": fingerprint(config, config.val_path) if config.val_path is not None else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Sources: what a path names


@dataclass(frozen=True)
class _Source:
    """A corpus on disk: its kind (text, jsonl, parquet, datasets, bin) and the files read, in order."""

    root: Path
    kind: str
    files: tuple[Path, ...]


def _role(path: str, config: DataConfig) -> str:
    return "data.val_path" if path == config.val_path and path != config.path else "data.path"


def _source(path: str | None, config: DataConfig, role: str) -> _Source:
    if path is None:
        raise DataError(f"{role} is not set, so there is no built-in data to read.",
                        f"set {role}=FILE_OR_FOLDER ({_FORMATS_FIX}).")
    root = Path(path).expanduser()
    if not root.exists():
        raise _missing(path, role)
    if root.is_dir():
        return _folder_source(root, role)
    return _file_source(root, config, role)


def _missing(path: str, role: str) -> DataError:
    if _HUB_ID.match(path) and Path(path).suffix.lower() not in (".txt", ".jsonl", ".parquet", ".bin"):
        return DataError(f"{role}={path} is not a file or folder on this machine; it looks like a Hugging Face Hub "
                         "dataset name, and nothing is ever downloaded.",
                         f"download it where there is a network (e.g. datasets.load_dataset('{path}', "
                         "split='train').save_to_disk('DIR')), copy DIR here and set "
                         f"{role}=DIR.")
    return DataError(f"{role}={path}: there is no such file or folder.",
                     f"check the path (relative paths are taken from {os.getcwd()}).")


def _file_source(root: Path, config: DataConfig, role: str) -> _Source:
    name = root.name.lower()
    kinds = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".bin": "bin"}
    kind = kinds.get(root.suffix.lower())
    if kind is None:
        what = f"a {root.suffix} file" if root.suffix else "a file without a suffix"
        fix = _FORMATS_FIX + (" (convert a .csv with pandas: pd.read_csv(FILE).to_json('FILE.jsonl', "
                              "orient='records', lines=True))" if name.endswith(".csv") else "")
        raise DataError(f"{role}={root}: {what} is not a format the built-in data reads.", fix + ".")
    if root.stat().st_size == 0:
        raise DataError(f"{role}={root} is empty.", "give a file that holds text (or token ids for .bin).")
    if kind == "bin":
        _bin_dtype(root, config, role)
    return _Source(root, kind, (root,))


def _folder_source(root: Path, role: str) -> _Source:
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{role}={root} holds a datasets DatasetDict (splits: {', '.join(splits) or 'none'}), "
                        "not one dataset.",
                        f"name the split's folder, e.g. {role}={root / (splits[0] if splits else 'train')}"
                        + (f" and data.val_path={root / 'validation'}" if "validation" in splits else "") + ".")
    files = _listed(root)
    if (root / "state.json").is_file() or (root / "dataset_info.json").is_file():
        return _Source(root, "datasets", tuple(files))
    if not files:
        raise DataError(f"{role}={root} is an empty folder.", "give a folder that holds text files, or a file.")
    suffixes = {f.suffix.lower() for f in files}
    if suffixes in ({".jsonl"}, {".parquet"}):
        return _Source(root, suffixes.pop().lstrip("."), tuple(files))
    mixed = sorted(s for s in suffixes if s in _FORMAT_SUFFIXES)
    if mixed:
        raise DataError(f"{role}={root} holds {', '.join(mixed)} files beside other files, and a folder is read "
                        "as one format (all .jsonl, all .parquet, or every file one text document).",
                        "put each format in a folder of its own, or name one file.")
    return _Source(root, "text", tuple(files))


def _listed(root: Path) -> list[Path]:
    """Files under root in order of relative path; hidden names and __pycache__ are left out."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d != "__pycache__")
        found += [Path(folder) / n for n in names if not n.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _bin_dtype(path: Path, config: DataConfig, role: str) -> np.dtype:
    if config.bin_dtype not in ("uint16", "uint32"):
        raise DataError(f"data.bin_dtype={config.bin_dtype} is not a token dtype.", "use uint16 or uint32.")
    dtype = np.dtype(np.uint32 if path.name.lower().endswith(".u32.bin") else config.bin_dtype)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{role}={path} has {size:,} bytes, not a whole number of {dtype.name} token ids.",
                        "check the file is complete and data.bin_dtype is the dtype it was written with.")
    return dtype


# ---------------------------------------------------------------------------------------------
# Documents of a source


def _documents(source: _Source, config: DataConfig) -> Iterator[str]:
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents,
               "datasets": _datasets_documents}
    return readers[source.kind](source, config)


def _text_documents(source: _Source, config: DataConfig) -> Iterator[str]:
    for file in source.files:
        raw = file.read_bytes()
        if b"\x00" in raw:
            raise DataError(f"{file} is a binary file (it holds NUL bytes), and every file of {source.root} "
                            "is read as a text document.",
                            "remove it from the folder, or give a folder of text files only.")
        yield raw.decode("utf-8", errors="replace")


def _jsonl_documents(source: _Source, config: DataConfig) -> Iterator[str]:
    key = config.text_field
    for file in source.files:
        with open(file, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(f"{file}, line {number}: not a JSON object ({str(err).split(':')[0]}).",
                                    "make every line one JSON object such as {\"" + key + "\": \"...\"} "
                                    "(JSON Lines), or delete the line.") from None
                if not isinstance(record, dict) or key not in record:
                    fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{file}, line {number}: no \"{key}\" field (it has: {fields or 'nothing'}).",
                                    "set data.text_field to the field that holds the text, or add it to the line.")
                if not isinstance(record[key], str):
                    raise DataError(f"{file}, line {number}: \"{key}\" is a {type(record[key]).__name__}, not text.",
                                    "give each line's text as a JSON string.")
                yield record[key]


def _parquet_documents(source: _Source, config: DataConfig) -> Iterator[str]:
    pa = _optional("pyarrow", "pyarrow", "read .parquet files")
    pq = importlib.import_module("pyarrow.parquet")
    key = config.text_field
    for file in source.files:
        try:
            table = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{file} is not a readable Parquet file ({err}).",
                            "check the file is complete, or give it the suffix of its format.") from None
        names = table.schema_arrow.names
        if key not in names:
            raise DataError(f"{file} has no column \"{key}\" (it has: {', '.join(names)}).",
                            "set data.text_field to the column that holds the text.")
        row = 0
        for batch in table.iter_batches(batch_size=_PARQUET_ROWS, columns=[key]):
            column = batch.column(0)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                raise DataError(f"{file}: column \"{key}\" holds {column.type}, not text.",
                                "set data.text_field to a column of strings.")
            if column.null_count:
                first = row + column.is_null().to_pylist().index(True)
                raise DataError(f"{file}: row {first} of column \"{key}\" is null.",
                                "drop or fill the rows without text.")
            row += len(column)
            yield from column.to_pylist()


def _datasets_documents(source: _Source, config: DataConfig) -> Iterator[str]:
    datasets = _optional("datasets", "datasets", "read a folder written by save_to_disk")
    key = config.text_field
    try:
        dataset = datasets.load_from_disk(str(source.root))
    except Exception as err:  # noqa: BLE001 - any failure means the folder is not a readable dataset
        raise DataError(f"{source.root} is not a readable datasets folder ({type(err).__name__}: {err}).",
                        "write it again with Dataset.save_to_disk, or give a file.") from None
    if key not in dataset.column_names:
        raise DataError(f"{source.root} has no column \"{key}\" (it has: {', '.join(dataset.column_names)}).",
                        "set data.text_field to the column that holds the text.")
    row = 0
    for batch in dataset.select_columns([key]).iter(batch_size=_PARQUET_ROWS):
        for offset, text in enumerate(batch[key]):
            if not isinstance(text, str):
                raise DataError(f"{source.root}: row {row + offset} of column \"{key}\" is "
                                f"{type(text).__name__}, not text.", "drop or fill the rows without text.")
        row += len(batch[key])
        yield from batch[key]


def _optional(module: str, package: str, purpose: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"The package {package} is needed to {purpose}, and it is not installed.",
                        f"pip install {package}") from None


# ---------------------------------------------------------------------------------------------
# Tokenizers


@dataclass(frozen=True)
class _Tokenizer:
    """Turns a list of documents into one id stream, the end-of-document id after each."""

    name: str
    vocab_size: int
    eod: int
    identity: str  # what names it in a fingerprint: "bytes" or the sha256 of tokenizer.json
    encode_batch: Callable[[list[str]], list[list[int]]] | None = field(default=None, compare=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode(self, documents: list[str]) -> np.ndarray:
        if self.encode_batch is None:
            return _bytes_ids(documents, self.eod)
        encoded = self.encode_batch(documents)
        ids = np.empty(sum(map(len, encoded)) + len(encoded), dtype=self.dtype)
        at = 0
        for one in encoded:
            ids[at:at + len(one)] = one
            at += len(one)
            ids[at] = self.eod
            at += 1
        return ids


def _bytes_ids(documents: list[str], eod: int) -> np.ndarray:
    raw = [doc.encode("utf-8", errors="replace") for doc in documents]
    lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
    ends = np.cumsum(lengths + 1) - 1
    ids = np.empty(int(ends[-1]) + 1 if len(raw) else 0, dtype=np.uint16)
    text = np.ones(len(ids), dtype=bool)
    text[ends] = False
    ids[text] = np.frombuffer(b"".join(raw), dtype=np.uint8)
    ids[ends] = eod
    return ids


def _tokenizer(config: DataConfig) -> _Tokenizer:
    if config.tokenizer == BYTES_TOKENIZER:
        eod = BYTES_EOD if config.eod_token is None else config.eod_token
        _check_eod(eod, BYTES_VOCAB, "the bytes tokenizer")
        return _Tokenizer(BYTES_TOKENIZER, BYTES_VOCAB, eod, BYTES_TOKENIZER)
    file = _tokenizer_file(config.tokenizer)
    stat = file.stat()
    return _loaded_tokenizer(str(file.resolve()), stat.st_size, stat.st_mtime_ns, config.eod_token)


def _tokenizer_file(name: str) -> Path:
    file = Path(name).expanduser()
    if file.is_dir():
        file = file / "tokenizer.json"
    if file.is_file():
        return file
    if not Path(name).expanduser().exists() and not name.endswith(".json"):
        raise DataError(f"data.tokenizer={name} is not a file here; a tokenizer is never downloaded.",
                        "save it where there is a network (transformers.AutoTokenizer.from_pretrained(NAME)"
                        ".save_pretrained('DIR') writes DIR/tokenizer.json), copy it here and set "
                        "data.tokenizer=DIR/tokenizer.json, or use data.tokenizer=bytes.")
    raise DataError(f"data.tokenizer={name}: there is no tokenizer.json there.",
                    "give the path of a tokenizer.json (or of the folder holding it), or data.tokenizer=bytes.")


_LOADED: dict[tuple, _Tokenizer] = {}


def _loaded_tokenizer(path: str, size: int, mtime_ns: int, eod_token: int | None) -> _Tokenizer:
    """A tokenizer.json loaded once per file version and end-of-document choice."""
    key = (path, size, mtime_ns, eod_token)
    if key not in _LOADED:
        tokenizers = _optional("tokenizers", "tokenizers", "read a tokenizer.json")
        try:
            loaded = tokenizers.Tokenizer.from_file(path)
        except Exception as err:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise DataError(f"data.tokenizer={path} is not a readable tokenizer.json ({err}).",
                            "give a file written by tokenizers' Tokenizer.save or a fast tokenizer's "
                            "save_pretrained.") from None
        loaded.no_truncation()  # a saved truncation (e.g. 512) would silently cut every document
        loaded.no_padding()
        vocab = loaded.get_vocab_size(with_added_tokens=True)
        eod = eod_token if eod_token is not None else _named_eod(loaded, path)
        _check_eod(eod, vocab, path)
        fast = getattr(loaded, "encode_batch_fast", loaded.encode_batch)

        def encode_batch(documents: list[str]) -> list[list[int]]:
            return [one.ids for one in fast(documents, add_special_tokens=False)]

        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        _LOADED[key] = _Tokenizer(path, vocab, eod, digest, encode_batch)
    return _LOADED[key]


def _named_eod(tokenizer: Any, path: str) -> int:
    for name in EOD_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    raise DataError(f"data.tokenizer={path} has none of the end-of-document tokens {', '.join(EOD_NAMES)}.",
                    "set data.eod_token to the id that ends a document (tokenizer.token_to_id(NAME)), or add "
                    "such a special token to the tokenizer.")


def _check_eod(eod: int, vocab: int, what: str) -> None:
    if not 0 <= eod < vocab:
        raise DataError(f"data.eod_token={eod} is not an id of {what} (vocabulary {vocab:,}).",
                        f"give an id in [0, {vocab - 1}], or leave data.eod_token unset.")


# ---------------------------------------------------------------------------------------------
# Tokenizing and the cache


@dataclass
class _Ready:
    """A tokenized corpus in memory or cached already: nothing to commit or discard."""

    tokens: np.ndarray

    @property
    def count(self) -> int:
        return len(self.tokens)

    def commit(self) -> np.ndarray:
        return self.tokens

    def discard(self) -> None:
        pass


@dataclass
class _Staged:
    """A tokenized corpus in a temporary file that commit() renames into the cache (discard()
    removes it, leaving the cache as it was)."""

    temp: Path
    final: Path
    made_folders: tuple[Path, ...] = ()
    count: int = 0
    sidecar: dict[str, Any] = field(default_factory=dict)
    temp_gone: bool = False

    def commit(self) -> np.ndarray:
        os.replace(self.temp, self.final)  # the .bin first: a sidecar never names a partial file
        _write_atomically(self.final.with_suffix(".json"), json.dumps(self.sidecar, indent=1))
        self.temp_gone = True
        return _open_cached(self.final, self.sidecar)

    def discard(self) -> None:
        if not self.temp_gone:
            self.temp.unlink(missing_ok=True)
            self.temp_gone = True
        for folder in self.made_folders:  # deepest first; one that is not empty stays
            try:
                folder.rmdir()
            except OSError:
                break


_Pending = _Ready | _Staged


def _commit_all(pending: list[_Pending]) -> list[np.ndarray]:
    try:
        return [item.commit() for item in pending]
    except BaseException:
        for item in reversed(pending):  # the last made shares the first's folder: it goes first
            item.discard()
        raise


def _build(source: _Source, tokenizer: _Tokenizer | None, config: DataConfig, role: str) -> _Pending:
    if source.kind == "bin":
        return _Ready(np.memmap(source.root, dtype=_bin_dtype(source.root, config, role), mode="r"))
    if tokenizer is None:
        raise ValueError(f"{source.root}: a text corpus is read with a tokenizer (every caller makes one)")
    if config.cache_dir is None:
        chunks, documents = _tokenized_chunks(source, tokenizer, config, role)
        tokens = np.concatenate(list(chunks))
        _check_has_text(source, role, len(tokens), documents[0])
        return _Ready(tokens)
    folder = Path(config.cache_dir).expanduser()
    final = folder / f"tokens-{_corpus_fingerprint(source, config, tokenizer)}.bin"
    cached = _cached(final)
    if cached is not None:
        return _Ready(cached)
    return _write_temporary(source, tokenizer, config, role, final)


def _tokenized_chunks(source: _Source, tokenizer: _Tokenizer, config: DataConfig,
                      role: str) -> tuple[Iterator[np.ndarray], list[int]]:
    """Id chunks of at most _CHUNK_CHARS of text (or one longer document) each, and a one-item
    list counting the documents seen so far."""
    documents = [0]

    def chunks() -> Iterator[np.ndarray]:
        batch: list[str] = []
        chars = 0
        for document in _documents(source, config):
            batch.append(document)
            chars += len(document)
            if chars >= _CHUNK_CHARS or len(batch) >= _CHUNK_DOCS:
                documents[0] += len(batch)
                yield tokenizer.encode(batch)
                batch, chars = [], 0
        documents[0] += len(batch)
        yield tokenizer.encode(batch) if batch else np.empty(0, dtype=tokenizer.dtype)

    return chunks(), documents


def _check_has_text(source: _Source, role: str, count: int, documents: int) -> None:
    if count <= documents:  # nothing but end-of-document ids
        raise DataError(f"{role}={source.root} holds no text ({documents} documents, all empty).",
                        "give a file or folder with text in it (or check data.text_field).")


def _write_temporary(source: _Source, tokenizer: _Tokenizer, config: DataConfig, role: str,
                     final: Path) -> _Staged:
    folder = final.parent
    made = tuple(p for p in (folder, *folder.parents) if not p.exists())
    folder.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{final.stem}.", suffix=".tmp", dir=folder)
    pending = _Staged(Path(name), final, made)
    try:
        chunks, documents = _tokenized_chunks(source, tokenizer, config, role)
        with os.fdopen(handle, "wb") as out:
            for ids in chunks:
                ids.tofile(out)
                pending.count += len(ids)
            out.flush()
            os.fsync(out.fileno())
        _check_has_text(source, role, pending.count, documents[0])
    except BaseException:
        pending.discard()
        raise
    pending.sidecar = {"version": _CACHE_VERSION, "dtype": tokenizer.dtype.name, "count": pending.count,
                       "documents": documents[0], "eod": tokenizer.eod, "vocab_size": tokenizer.vocab_size,
                       "tokenizer": tokenizer.name, "source": str(source.root)}
    return pending


def _cached(final: Path) -> np.ndarray | None:
    """The cached corpus when its sidecar vouches for a complete file, else None."""
    try:
        sidecar = json.loads(final.with_suffix(".json").read_text())
        if sidecar.get("version") != _CACHE_VERSION:
            return None
        return _open_cached(final, sidecar)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _open_cached(final: Path, sidecar: dict[str, Any]) -> np.ndarray:
    dtype, count = np.dtype(sidecar["dtype"]), int(sidecar["count"])
    if final.stat().st_size != dtype.itemsize * count:
        raise ValueError(f"{final} does not hold the {count} tokens its sidecar says")
    return np.memmap(final, dtype=dtype, mode="r", shape=(count,))


def _write_atomically(path: Path, text: str) -> None:
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _corpus_fingerprint(source: _Source, config: DataConfig, tokenizer: _Tokenizer | None = None) -> str:
    files = []
    for file in source.files:
        stat = file.stat()
        files.append([file.relative_to(source.root).as_posix() if file != source.root else file.name,
                      stat.st_size, stat.st_mtime_ns])
    parts: dict[str, Any] = {"version": _CACHE_VERSION, "kind": source.kind, "root": source.root.name, "files": files}
    if source.kind == "bin":
        parts["dtype"] = _bin_dtype(source.root, config, "data.path").name
    else:
        tokenizer = tokenizer or _tokenizer(config)
        parts.update(tokenizer=tokenizer.identity, eod=tokenizer.eod)
        if source.kind != "text":
            parts["text_field"] = config.text_field
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Splits


def _seq_len(config: DataConfig) -> int:
    if config.seq_len is None or config.seq_len <= 0:
        raise DataError(f"data.seq_len={config.seq_len}: the sequence length is not set to a positive number.",
                        "set data.seq_len, or leave it to the sequence length the plan was traced with.")
    return int(config.seq_len)


def _check_split_settings(config: DataConfig) -> None:
    if not 0.0 <= config.val_fraction < 0.5:
        raise DataError(f"data.val_fraction={config.val_fraction} is outside [0, 0.5): validation would take "
                        f"as much of data.path={config.path} as training, or more.",
                        "use a fraction such as 0.01, or give data.val_path a file of its own.")
    if config.val_path is not None and config.val_fraction > 0:
        raise DataError(f"Both data.val_path={config.val_path} and data.val_fraction={config.val_fraction} "
                        "name the validation data.", "give one of them.")


def _sequences(count: int, seq_len: int) -> int:
    return max(0, (count - 1) // seq_len)


def _split_points(config: DataConfig, sources: list[tuple[str, _Source]], counts: list[int], seq_len: int,
                  min_samples: int) -> tuple[int, tuple[int, int] | None]:
    """(token stop of train, (start, stop) of validation or None), refusing either below min_samples."""
    total = _sequences(counts[0], seq_len)
    if len(sources) > 1:
        _check_enough(sources[0], counts[0], total, seq_len, min_samples, "")
        _check_enough(sources[1], counts[1], _sequences(counts[1], seq_len), seq_len, min_samples, "")
        return total * seq_len + 1, (0, _sequences(counts[1], seq_len) * seq_len + 1)
    held = int(total * config.val_fraction)
    train = total - held
    _check_enough(sources[0], counts[0], train, seq_len, min_samples,
                  f" once {held:,} are held out for validation" if held else "")
    if config.val_fraction == 0:
        return train * seq_len + 1, None
    if held < min_samples or held == 0:
        raise DataError(f"data.val_fraction={config.val_fraction} of data.path={sources[0][1].root} is "
                        f"{_plural(held, 'sequence')} of {seq_len} tokens, fewer than the "
                        f"{max(min_samples, 1):,} one validation batch takes.",
                        "raise data.val_fraction, or give data.val_path a file of its own.")
    return train * seq_len + 1, (train * seq_len, total * seq_len + 1)


def _check_enough(source: tuple[str, _Source], count: int, sequences: int, seq_len: int, min_samples: int,
                  held: str) -> None:
    role, where = source
    if sequences < max(min_samples, 1):
        raise DataError(f"{role}={where.root} holds {count:,} tokens: {_plural(sequences, 'sequence')} of "
                        f"{seq_len} tokens{held}, fewer than the {max(min_samples, 1):,} of one global batch.",
                        "give more text, or lower train.global_batch_size or the sequence length.")


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"
