"""Tokenizers for ``boost-train``: bytes, a local Hugging Face tokenizer, or a trained BPE.

``data.tokenizer`` names one (:func:`load_tokenizer` reads the spec):

- ``bytes`` (the default): UTF-8 bytes are the tokens, ids 0..255; nothing to
  load or save (:meth:`Tokenizer.save` writes no file; a run without
  ``tokenizer.json`` is a bytes run).
- a path: a ``tokenizer.json`` file, or a folder holding one, loaded offline with
  ``tokenizers.Tokenizer.from_file``; a folder without one is tried with
  ``transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)``
  (its fast backend). A copy is saved as the run folder's ``tokenizer.json``.
- ``bpe:<vocab>`` (``bpe:2048``): a byte-level BPE trained with ``tokenizers`` on
  the training split's text, saved as the run folder's ``tokenizer.json``; a run
  folder that already has one (a resumed run) reuses it instead of retraining.

Encoding adds no special tokens (no BOS/EOS): the corpus is one packed stream.

The model's vocabulary is :func:`padded_vocab` of :attr:`Tokenizer.vocab_size`
(rounded up to a multiple of 64 for the GEMMs); the padding ids are never
produced by :meth:`Tokenizer.encode`, so they are never targets, and generation
masks them. :func:`tokenizer_for_run` gives export and generation the tokenizer
a run trained with.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("boost_compile.train")

TOKENIZER_FILE = "tokenizer.json"
BYTES = "bytes"
BPE_PREFIX = "bpe:"
BYTE_VOCAB = 256
VOCAB_MULTIPLE = 64
MAX_VOCAB = 2**32 - 1  # ids must fit the uint32 token cache


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``: the model's vocabulary for ``n`` tokens."""
    if n < 1 or multiple < 1:
        raise ValueError(f"need n >= 1 and multiple >= 1, got n={n} multiple={multiple}")
    return -(-n // multiple) * multiple


def parse_spec(spec: str) -> tuple[str, Any]:
    """``("bytes", None)``, ``("bpe", vocab)`` or ``("path", Path)``; ValueError naming the fix."""
    spec = str(spec).strip()
    if spec == BYTES:
        return BYTES, None
    if spec.startswith(BPE_PREFIX):
        value = spec[len(BPE_PREFIX):]
        try:
            vocab = int(value)
        except ValueError:
            raise ValueError(f"data.tokenizer={spec!r}: the BPE vocabulary must be an integer (bpe:2048)") from None
        if not BYTE_VOCAB < vocab <= MAX_VOCAB:
            raise ValueError(
                f"data.tokenizer={spec!r}: a byte-level BPE needs more than {BYTE_VOCAB} tokens "
                f"(the byte alphabet) and at most {MAX_VOCAB}"
            )
        return "bpe", vocab
    path = Path(spec).expanduser()
    if path.is_file():
        return "path", path
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return "path", path / TOKENIZER_FILE
        if (path / "tokenizer_config.json").is_file():
            return "path", path  # a transformers tokenizer folder without tokenizer.json
        raise ValueError(f"data.tokenizer={spec!r}: the folder holds no {TOKENIZER_FILE} (or tokenizer_config.json)")
    raise ValueError(
        f"data.tokenizer={spec!r} is not 'bytes', 'bpe:<vocab>' (bpe:2048) or an existing "
        f"{TOKENIZER_FILE} / folder holding one"
    )


class ByteTokenizer:
    """Bytes are tokens: ids 0..255, no special tokens; :meth:`Tokenizer.bytes`'s ids, as tensors."""

    vocab_size: int = BYTE_VOCAB

    def encode(self, text: str | bytes) -> Tensor:
        """UTF-8 bytes of ``text`` as a 1-D int64 tensor."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Text of a sequence of byte ids; invalid UTF-8 becomes U+FFFD."""
        values = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
        if any(not 0 <= v < self.vocab_size for v in values):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return bytes(values).decode("utf-8", errors="replace")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - installed with transformers
        raise ImportError(
            "data.tokenizer other than 'bytes' needs the `tokenizers` package (pip install tokenizers)"
        ) from exc
    return tokenizers


class Tokenizer:
    """Text to token ids and back: bytes (``backend=None``) or a ``tokenizers.Tokenizer``.

    ``vocab_size`` is the true size (the largest id + 1); the model's vocabulary
    is ``padded_vocab(vocab_size)``. ``name`` says where it came from.
    """

    def __init__(self, backend: Any = None, name: str = BYTES) -> None:
        self.backend = backend
        self.name = name
        if backend is None:
            self.vocab_size = BYTE_VOCAB
        else:
            ids = backend.get_vocab(with_added_tokens=True).values()
            self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self._fingerprint: str | None = None

    # -- construction
    @classmethod
    def bytes(cls) -> Tokenizer:
        return cls()

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> Tokenizer:
        """A ``tokenizer.json`` file, or a transformers tokenizer folder (offline)."""
        path = Path(path).expanduser()
        if path.is_dir():
            return cls(_auto_backend(path), name or str(path))
        return cls(_tokenizers().Tokenizer.from_file(str(path)), name or str(path))

    @classmethod
    def from_str(cls, json_text: str, name: str) -> Tokenizer:
        return cls(_tokenizers().Tokenizer.from_str(json_text), name)

    # -- the interface
    @property
    def is_bytes(self) -> bool:
        return self.backend is None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        if self.backend is None:
            return list(text.encode("utf-8"))
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (parallel in the ``tokenizers`` backend)."""
        if self.backend is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ValueError for ids outside ``[0, vocab_size)`` (e.g. padding ids)."""
        values = [int(i) for i in ids]
        bad = [v for v in values if not 0 <= v < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got {bad[:5]}")
        if self.backend is None:
            return bytes(values).decode("utf-8", errors="replace")
        return self.backend.decode(values, skip_special_tokens=False)

    def to_str(self) -> str:
        """The ``tokenizer.json`` text ('' for bytes)."""
        return "" if self.backend is None else self.backend.to_str()

    def save(self, folder: str | Path) -> Path | None:
        """Write ``folder/tokenizer.json`` atomically; bytes writes nothing and returns None."""
        if self.backend is None:
            return None
        path = Path(folder) / TOKENIZER_FILE
        atomic_write_text(path, self.to_str())
        return path

    def fingerprint(self) -> str:
        """A content hash: equal fingerprints tokenize equally (the token cache's key)."""
        if self._fingerprint is None:
            content = "bytes-utf8-v1" if self.backend is None else self.to_str()
            self._fingerprint = hashlib.sha256(content.encode("utf-8")).hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def _auto_backend(folder: Path) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(f"{folder} has no {TOKENIZER_FILE}; loading it needs `transformers`") from exc
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{folder}: {type(tok).__name__} has no fast (tokenizers) backend to use")
    return backend


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None, name: str | None = None) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens trained on ``texts`` (any text round-trips)."""
    tk = _tokenizers()
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    backend.train_from_iterator(texts, trainer, length=length)
    return Tokenizer(backend, name or f"{BPE_PREFIX}{vocab_size}")


def load_tokenizer(
    spec: str,
    run_dir: Path | None = None,
    train_text: Callable[[], Iterable[str]] | None = None,
) -> Tokenizer:
    """The tokenizer ``data.tokenizer=spec`` names (see the module docstring).

    ``run_dir``: the run folder; a path or trained BPE is saved there as
    ``tokenizer.json``, and ``bpe:`` reuses the one already there (a resumed run).
    ``train_text``: returns the training split's texts, called only when a BPE
    has to be trained.
    """
    kind, value = parse_spec(spec)
    if kind == BYTES:
        return Tokenizer.bytes()
    run_file = Path(run_dir) / TOKENIZER_FILE if run_dir is not None else None
    if kind == "path":
        tok = Tokenizer.from_file(value, name=str(spec))
        if run_dir is not None:
            tok.save(run_dir)
        return tok
    if run_file is not None and run_file.is_file():
        tok = Tokenizer.from_file(run_file, name=f"{spec} ({run_file})")
        log.info("tokenizer: reused %s (%s tokens)", run_file, f"{tok.vocab_size:,}")
        return tok
    if train_text is None:
        raise ValueError(f"data.tokenizer={spec}: no {TOKENIZER_FILE} in the run folder and no text to train on")
    begin = time.perf_counter()
    tok = train_bpe(train_text(), value, name=str(spec))
    where = tok.save(run_dir) if run_dir is not None else None
    log.info(
        "tokenizer: trained %s (%s tokens) in %.1fs%s",
        spec, f"{tok.vocab_size:,}", time.perf_counter() - begin, f" -> {where}" if where else "",
    )
    return tok


def _run_config(run_dir: Path) -> tuple[Path, Any]:
    """The run folder holding ``.hydra/config.yaml`` at or above ``run_dir``, and that config."""
    from omegaconf import OmegaConf

    start = Path(run_dir).expanduser().resolve()
    for folder in (start, *start.parents[:3]):
        config = folder / ".hydra" / "config.yaml"
        if config.is_file():
            return folder, OmegaConf.load(config)
    return start, None


def tokenizer_for_run(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a ``boost-train`` run trained with (for export and generation).

    ``run_dir`` is the run folder (or a folder inside it, like a checkpoint). Its
    ``tokenizer.json`` when the run's ``data.tokenizer`` is not ``bytes``, else
    what the spec names; a run without the key (older runs) used bytes.
    """
    folder, config = _run_config(Path(run_dir))
    spec = BYTES
    if config is not None:
        spec = str(config.get("data", {}).get("tokenizer", BYTES) or BYTES)
    if spec == BYTES:
        return Tokenizer.bytes()
    run_file = folder / TOKENIZER_FILE
    if run_file.is_file():
        return Tokenizer.from_file(run_file, name=f"{spec} ({run_file})")
    kind, value = parse_spec(spec)  # ValueError if the path is gone
    if kind == "path":
        return Tokenizer.from_file(value, name=spec)
    raise FileNotFoundError(f"{folder}: data.tokenizer={spec} but the run folder has no {TOKENIZER_FILE}")
