"""A GGUF file's header read in one pass: its metadata values and its tensors mapped in place.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value, so a vocabulary of
128k tokens and 280k merges took it ~8 s (Llama-3.2-1B, 2-core Zen 4, loaded); the loader needs
none of those strings, only the config's values, the vocabulary's length and the tensors. This
reader walks the header with `struct` over the mapped file (the GGUF v2/v3 layout: magic,
version, tensor and key counts, the key-value pairs, the tensor infos, data aligned to
`general.alignment`), keeps every scalar, string and numeric array (as lists), and keeps only
the length of string arrays longer than `_MAX_KEPT_STRINGS`. What it gives has the parts of
`GGUFReader`'s API the loader reads (`fields[key].contents()`, `len(fields[key].data)`,
`tensors` with `name`, `tensor_type`, `shape`, `data`, `data_offset`), so tests compare the two
directly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFHeader", "HeaderField", "IndexedTensor", "map_tensors", "read_gguf_header"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}  # fmt: skip
_MAX_KEPT_STRINGS = 1024  # longer string arrays (vocabularies, merges) keep only their length
# element-typed tensor views, as GGUFReader gives them; other types are bytes per row
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One metadata value: `contents()` as `gguf.ReaderField` gives it (a long string array:
    None), `data` one entry per array item or one for a scalar (only its length is read)."""

    value: Any
    data: range

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class IndexedTensor:
    """What `load_gguf_weights` reads of a `gguf.ReaderTensor`."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF dims (innermost first), as ReaderTensor.shape
    data: np.ndarray  # read-only memmap view of the file, as ReaderTensor.data
    data_offset: int = 0  # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A GGUF file's metadata (`fields`) and tensors, as far as the loader reads them."""

    fields: dict[str, HeaderField]
    tensors: list[IndexedTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise ValueError("string past the end of the file")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> tuple[Any, int]:
        """(value, items) of one metadata value of type `kind` (items: 1 for a scalar, as
        `ReaderField.data` has one entry then)."""
        if kind == _STRING:
            return self.string(), 1
        if kind != _ARRAY:
            return self.take(_SCALAR[kind]), 1
        item, count = self.take("<I"), self.take("<Q")
        if item == _STRING:
            if count <= _MAX_KEPT_STRINGS:
                return [self.string() for _ in range(count)], count
            for _ in range(count):  # skipped: each string's length only
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return None, count
        if item == _ARRAY or item not in _NUMPY:
            raise ValueError(f"unsupported array item type {item}")
        dtype = np.dtype(_NUMPY[item])
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return values.tolist(), count


def read_gguf_header(path: Path) -> GGUFHeader:
    """The metadata and tensors of the GGUF at `path` (little-endian, version 2 or 3).

    Raises:
        ValueError: not a GGUF file this reader takes (magic, version, a value past its end).
    """
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError("not a GGUF file (magic)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (big-endian, or not 2 or 3) is not supported")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    fields: dict[str, HeaderField] = {}
    for _ in range(n_kv):
        key = cur.string()
        value, items = cur.value(cur.take("<I"))
        fields[key] = HeaderField(value, range(items))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, cur.take("<I"), dims, cur.take("<Q")))
    align = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    start = -(-cur.pos // align) * align
    entries = [(name, kind, dims, start + offset) for name, kind, dims, offset in infos]
    return GGUFHeader(fields, map_tensors(mm, entries))


def map_tensors(mm: np.ndarray, entries: list[tuple[str, int, list[int], int]]) -> list:
    """`IndexedTensor`s over the mapped file `mm` for (name, ggml type, dims, absolute offset)
    entries: element-typed views for plain types, bytes per row for block types.

    Raises:
        ValueError: an unknown type, or a tensor past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    tensors = []
    for name, type_value, dims, offset in entries:
        qtype = GGMLQuantizationType(type_value)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims)) * type_size // block
        np_dims = tuple(reversed(dims))
        raw = mm[offset : offset + n_bytes]
        if raw.size != n_bytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        dtype = _PLAIN.get(qtype.name)
        if dtype is not None:
            data = raw.view(dtype).reshape(np_dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, qtype))
        shape = np.asarray(dims, dtype=np.uint64)
        tensors.append(IndexedTensor(name, qtype, shape, data, offset))
    return tensors
