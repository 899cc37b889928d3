"""Data: files into documents, byte tokens and packing, dp sampling, sp slicing and the step's
sequence layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

# public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "Batch": "batch",
    "decode": "corpus",
    "default_corpus_paths": "read",
    "document_positions": "batch",
    "dp_rows": "batch",
    "eval_batches": "batch",
    "full_batch": "batch",
    "slice_batch": "batch",
    "window_rows": "batch",
    "encode": "corpus",
    "get_batch": "batch",
    "IGNORE_INDEX": "batch",
    "PackedCorpus": "corpus",
    "read_documents": "read",
    "sample_index": "batch",
    "SEP_ID": "corpus",
    "starts_from_separators": "batch",
    "VOCAB_SIZE": "corpus",
}

__all__ = [
    "Batch",
    "decode",
    "default_corpus_paths",
    "document_positions",
    "encode",
    "get_batch",
    "IGNORE_INDEX",
    "PackedCorpus",
    "read_documents",
    "sample_index",
    "SEP_ID",
    "starts_from_separators",
    "VOCAB_SIZE",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs
    from dtensor_ulysses.data.batch import (
        IGNORE_INDEX,
        Batch,
        document_positions,
        get_batch,
        sample_index,
        starts_from_separators,
    )
    from dtensor_ulysses.data.corpus import (
        SEP_ID,
        VOCAB_SIZE,
        PackedCorpus,
        decode,
        encode,
    )
    from dtensor_ulysses.data.read import (
        default_corpus_paths,
        read_documents,
    )
