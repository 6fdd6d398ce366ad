"""A GGUF file's header, read straight from the file with the standard library: no gguf-py,
numpy or torch, and no tensor is touched. The model check (engine/models/source.py) reads the
architecture with it in milliseconds, before anything starts, and the loader
(gguf_loader.py) its metadata and where each tensor lies: gguf-py's GGUFReader parses every
value of the vocabulary into numpy first (1.4 s for SmolLM2's 49k tokens, at every engine
start), which nothing here reads.

    "GGUF" | version u32 | tensor count u64 | key-value count u64 | key-values | tensor infos | data
    key-value: key (u64 length + UTF-8) | value type u32 | value
    value: a scalar, a string (u64 length + bytes), or an array (element type u32 | count u64 | elements)
    tensor info: name (u64 length + UTF-8) | dims u32 | each dim u64 | type u32 | offset u64
    data: at the first multiple of general.alignment (32 by default) after the infos
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf-py reads (version 1 had 32-bit lengths)
# GGUF value type -> struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying (a row's length) first
    type: int  # a GGMLQuantizationType value
    offset: int  # bytes from the start of the file


@dataclass(frozen=True)
class GGUFLayout:
    metadata: dict[str, object]  # every scalar and string value; arrays (the vocabulary) skipped
    tensors: list[TensorInfo]


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file we can read; the message says why in a few words."""


def read_gguf_header(path: Path) -> dict[str, object]:
    """Every scalar or string metadata value by key; arrays (the vocabulary) are skipped."""
    return _read(path, with_tensors=False).metadata


def read_gguf_layout(path: Path) -> GGUFLayout:
    """The metadata (as read_gguf_header) and every tensor's name, shape, type and place."""
    return _read(path, with_tensors=True)


def _read(path: Path, with_tensors: bool) -> GGUFLayout:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise GGUFHeaderError("not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _layout(data, with_tensors)
        except (struct.error, UnicodeDecodeError, OverflowError):
            raise GGUFHeaderError("a truncated or corrupt GGUF header") from None


def _layout(data: mmap.mmap, with_tensors: bool) -> GGUFLayout:
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", data, len(MAGIC))
    if version not in VERSIONS:
        raise GGUFHeaderError(f"GGUF version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})")
    offset, values = len(MAGIC) + 20, {}
    for _ in range(num_kv):
        key, offset = _string(data, offset)
        (kind,), offset = struct.unpack_from("<I", data, offset), offset + 4
        if kind == _ARRAY:
            offset = _skip_array(data, offset)
        else:
            values[key.decode()], offset = _value(data, offset, kind)
    if not with_tensors:
        return GGUFLayout(values, [])
    infos = []
    for _ in range(num_tensors):
        name, offset = _string(data, offset)
        (num_dims,) = struct.unpack_from("<I", data, offset)
        dims = struct.unpack_from(f"<{num_dims}Q", data, offset + 4)
        kind, start = struct.unpack_from("<IQ", data, offset + 4 + 8 * num_dims)
        infos.append((name.decode(), dims, kind, start))
        offset += 4 + 8 * num_dims + 12
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = -(-offset // alignment) * alignment
    return GGUFLayout(values, [TensorInfo(name, dims, kind, data_start + start) for name, dims, kind, start in infos])


def _value(data: mmap.mmap, offset: int, kind: int) -> tuple[object, int]:
    if kind == _STRING:
        raw, offset = _string(data, offset)
        return raw.decode(), offset
    if kind not in _SCALARS:
        raise GGUFHeaderError(f"a corrupt GGUF header (value type {kind})")
    return struct.unpack_from(_SCALARS[kind], data, offset)[0], offset + struct.calcsize(_SCALARS[kind])


def _string(data: mmap.mmap, offset: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    end = offset + 8 + length
    if end > len(data):
        raise GGUFHeaderError("a truncated or corrupt GGUF header")
    return data[offset + 8:end], end


def _skip_array(data: mmap.mmap, offset: int) -> int:
    kind, count = struct.unpack_from("<IQ", data, offset)
    offset += 12
    if kind in _SCALARS:
        return offset + count * struct.calcsize(_SCALARS[kind])
    if kind != _STRING:  # nested arrays: no model file has them
        raise GGUFHeaderError(f"a corrupt GGUF header (array of type {kind})")
    for _ in range(count):  # the vocabulary: ~10^5 strings, a few ms
        offset += 8 + struct.unpack_from("<Q", data, offset)[0]
    return offset
