"""Data: files into documents, byte tokens and packing, dp sampling, sp slicing and the step's
sequence layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtensor_ulysses._public import lazy_exports

if TYPE_CHECKING:  # the public names, written once (__all__ and the lazy map read them)
    from dtensor_ulysses.data.batch import (
        IGNORE_INDEX,
        Batch,
        document_positions,
        eval_batches,
        full_batch,
        get_batch,
        sample_index,
        slice_batch,
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

__getattr__, __dir__, __all__ = lazy_exports(__name__)
