"""ftrain.data: sources with fingerprints and a resumable, elastic data cursor.

See ``docs/data.md``. The pieces:

- sources (``sources.py``): random access to ``(x, y)`` windows by global sample index;
- the pure sampler (``sampler.py``): ``(cursor, key, rank, world) -> (indices, next cursor)``;
- the prefetching :class:`Loader` (``loader.py``) and fixed validation batches;
- text corpora tokenized once and cached (``text.py``), the default stdlib corpus
  (``corpus.py``) and fingerprints (``fingerprint.py``).
"""

from ftrain.data.corpus import stdlib_corpus, stdlib_files
from ftrain.data.fingerprint import (
    DataFingerprintError,
    cache_dir,
    check_fingerprint,
    file_digest,
    make_fingerprint,
)
from ftrain.data.loader import (
    Loader,
    LoaderIterator,
    check_sample_shapes,
    check_token_ids,
    val_batches,
)
from ftrain.data.sampler import cursor_values, data_key, epoch_order, init_cursor, sample
from ftrain.data.sources import (
    DataFormatError,
    DataPathError,
    SampleShapeError,
    Source,
    TensorSource,
    TokenFileSource,
    TokenRangeError,
    make_source,
    register_source,
    source_from_config,
    source_names,
)
from ftrain.data.text import TextCorpusSource, resolve_text_files, tokenize_corpus
from ftrain.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataFingerprintError",
    "DataFormatError",
    "DataPathError",
    "Loader",
    "LoaderIterator",
    "SampleShapeError",
    "Source",
    "TensorSource",
    "TextCorpusSource",
    "TokenFileSource",
    "TokenRangeError",
    "cache_dir",
    "check_sample_shapes",
    "check_token_ids",
    "check_fingerprint",
    "cursor_values",
    "data_key",
    "epoch_order",
    "file_digest",
    "init_cursor",
    "make_fingerprint",
    "make_source",
    "register_source",
    "resolve_text_files",
    "sample",
    "source_from_config",
    "source_names",
    "tokenize_corpus",
    "stdlib_corpus",
    "stdlib_files",
    "val_batches",
]
