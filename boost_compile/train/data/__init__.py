"""boost-train's data: a text corpus, tokenized, packed into shuffled windows.

:mod:`.sources` reads the corpus (the standard library's source by default, no
download), :mod:`.cache` tokenizes it through the token cache (:func:`load_corpus`)
and :mod:`.packing` cuts it into each rank's train and val batches (:func:`make_loaders`).
A corpus already tokenized (nanoGPT's ``train.bin``/``val.bin``, ``.npy`` arrays) is
memory-mapped as it is by :mod:`.tokens_file` (``data=tokens``).
"""

from boost_compile.train.data.cache import (
    CACHE_ENV,
    cache_root,
    load_corpus,
    load_token_corpus,
    load_tokens,
    token_dtype,
)
from boost_compile.train.data.packing import Corpus, PackedTokens, make_loaders, split
from boost_compile.train.data.sources import source_stream, stdlib_files, stdlib_text, stdlib_tokens
from boost_compile.train.data.split_points import val_cut
from boost_compile.train.data.tokens_file import TokenFiles, token_files

# ByteTokenizer lives in train.tokenizer now; still importable from here
from boost_compile.train.tokenizer import ByteTokenizer

__all__ = [
    "CACHE_ENV",
    "ByteTokenizer",
    "Corpus",
    "PackedTokens",
    "TokenFiles",
    "cache_root",
    "load_corpus",
    "load_token_corpus",
    "load_tokens",
    "make_loaders",
    "source_stream",
    "split",
    "stdlib_files",
    "stdlib_text",
    "stdlib_tokens",
    "token_files",
    "token_dtype",
    "val_cut",
]
