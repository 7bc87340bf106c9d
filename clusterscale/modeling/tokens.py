"""Tokenisation without torch: a picklable text -> token-id tokenizer and the `Tokens` it produces.

The embed stage tokenises in Ray Data tasks on CPUs, apart from the encoder actors; importing this
module (and unpickling a `TextTokenizer`) loads only the Rust `tokenizers` library, not torch or
transformers, so a tokenise task starts in milliseconds and holds no model.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa


class Tokens:
    """Token ids of a list of texts, cut at max_length, as one flat id array with row offsets (Arrow's list
    layout, so a batch crosses Ray Data's object store without Python lists) and a per-text truncation flag."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, truncated: np.ndarray):
        self.ids = ids
        self.offsets = offsets
        self.lengths = np.diff(offsets)
        self.truncated = truncated

    @classmethod
    def from_lists(cls, input_ids: list[list[int]], truncated: np.ndarray) -> Tokens:
        lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
        offsets = np.zeros(len(input_ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((i for ids in input_ids for i in ids), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat, offsets, truncated)

    @classmethod
    def from_arrow(cls, ids: pa.ChunkedArray | pa.Array, truncated: pa.ChunkedArray | pa.Array) -> Tokens:
        """The columns written by `to_arrow` (one list<int32> and one bool column) back to Tokens."""
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        offsets = ids.offsets.to_numpy().astype(np.int64)
        flat = ids.values.to_numpy()[offsets[0]:offsets[-1]]
        return cls(flat, offsets - offsets[0], np.asarray(truncated, dtype=bool))

    def to_arrow(self) -> pa.LargeListArray:
        return pa.LargeListArray.from_arrays(pa.array(self.offsets), pa.array(self.ids, type=pa.int32()))

    def row(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.lengths)


class TextTokenizer:
    """A model's tokenizer cut to what embedding needs: texts -> ids with special tokens, at most max_length.

    Built in the driver from the transformers tokenizer; pickled as its Rust `tokenizers` backend (a JSON
    string), so the process that unpickles it needs neither transformers nor torch. A tokenizer without a
    Rust backend (a Python-only one) travels whole and is called through transformers."""

    def __init__(self, hf_tokenizer, max_length: int):
        self.max_length = max_length
        self.specials = frozenset(hf_tokenizer.all_special_ids)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend = _rust_tokenizer(backend.to_str()) if backend is not None else None  # a copy, reshaped
        self._hf = None if backend is not None else hf_tokenizer

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self._backend is not None:
            state["_backend"] = self._backend.to_str()
        return state

    def __setstate__(self, state: dict) -> None:
        if state["_backend"] is not None:
            state["_backend"] = _rust_tokenizer(state["_backend"])
        self.__dict__.update(state)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=True)]
        return self._hf(texts, truncation=False, add_special_tokens=True, verbose=False,
                        return_attention_mask=False, return_token_type_ids=False)["input_ids"]

    def __call__(self, texts: list[str]) -> Tokens:
        """Tokenise, cut at max_length keeping the closing special token, flag the cut texts."""
        ids_list = self._ids(list(texts))
        n = self.max_length
        truncated = np.zeros(len(ids_list), dtype=bool)
        for i, ids in enumerate(ids_list):
            if len(ids) > n:
                truncated[i] = True
                ids_list[i] = ids[:n - 1] + ids[-1:] if ids[-1] in self.specials else ids[:n]
        return Tokens.from_lists(ids_list, truncated)


def _rust_tokenizer(serialised: str):
    """The Rust tokenizer of a tokenizer.json string, without the truncation and padding its tokenizer.json may carry (MiniLM's pads
    and cuts every text to 128): cutting is ours (it keeps the closing token and flags the text), and
    padding happens per forward batch."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(serialised)
    backend.no_truncation()
    backend.no_padding()
    return backend


def single_threaded() -> None:
    """Make the Rust tokenizer use one thread in this process: a tokenise task holds one CPU (its
    Ray request); by default `encode_batch` fans out over every core of the node."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
