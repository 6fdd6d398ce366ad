"""A GGUF file's metadata values, read straight from its header with the standard library: no
gguf-py, numpy or torch, and no tensor is touched. The model check (engine/models/source.py)
reads the architecture with it in milliseconds, before anything starts.

    "GGUF" | version u32 | tensor count u64 | key-value count u64 | key-values | tensor infos | data
    key-value: key (u64 length + UTF-8) | value type u32 | value
    value: a scalar, a string (u64 length + bytes), or an array (element type u32 | count u64 | elements)
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf-py reads (version 1 had 32-bit lengths)
# GGUF value type -> struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file we can read; the message says why in a few words."""


def read_gguf_header(path: Path) -> dict[str, object]:
    """Every scalar or string metadata value by key; arrays (the vocabulary) are skipped."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise GGUFHeaderError("not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _metadata(data)
        except (struct.error, UnicodeDecodeError, OverflowError):
            raise GGUFHeaderError("a truncated or corrupt GGUF header") from None


def _metadata(data: mmap.mmap) -> dict[str, object]:
    version, _, num_kv = struct.unpack_from("<IQQ", data, len(MAGIC))
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
    return values


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
