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

A split model (llama.cpp's gguf-split, gguf-py's GGUFWriter with split_max_tensors/size) is N
such files, PREFIX-00001-of-0000N.gguf to PREFIX-0000N-of-0000N.gguf, side by side: each
carries split.no (0-based), split.count and split.tensors.count, the first also the model's
metadata (and vocabulary), and each tensor lies in exactly one of them. Any part's path names
the model: read_gguf_layout reads them all, gguf_split_parts lists them.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf-py reads (version 1 had 32-bit lengths)
# GGUF value type -> struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
# A part's file name, as llama.cpp (llama_split_path) and gguf-py (SHARD_NAME_FORMAT) write it.
_PART_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying (a row's length) first
    type: int  # a GGMLQuantizationType value
    offset: int  # bytes from the start of its file
    file: Path  # the file that holds it: the model's one file, or one of its parts


@dataclass(frozen=True)
class GGUFLayout:
    metadata: dict[str, object]  # every scalar and string value; arrays (the vocabulary) skipped
    tensors: list[TensorInfo]
    files: list[Path]  # the file, or a split model's parts in order


class GGUFHeaderError(ValueError):
    """The file is not a GGUF file we can read; the message says why in a few words."""


def read_gguf_header(path: Path) -> dict[str, object]:
    """Every scalar or string metadata value by key; arrays (the vocabulary) are skipped."""
    return _read(path, with_tensors=False).metadata


def read_gguf_layout(path: Path) -> GGUFLayout:
    """The model's metadata (as read_gguf_header) and every tensor's name, shape, type and
    place: of the file `path`, or of every part of the split model it is a part of, once each
    part is seen to be there and to fit (ValueError naming the files otherwise)."""
    layout = _read(path, with_tensors=True)
    count = layout.metadata.get(SPLIT_COUNT, 1)
    if count <= 1:
        return layout
    files = _part_files(path, layout.metadata.get(SPLIT_NO, 0), count)
    parts = [layout if file == path else _read_part(file) for file in files]
    for k, (file, part) in enumerate(zip(files, parts)):
        no, of = part.metadata.get(SPLIT_NO), part.metadata.get(SPLIT_COUNT)
        if (no, of) != (k, count):
            says = "a whole model" if no is None else f"part {no + 1} of {of}"
            raise ValueError(f"split GGUF: {file.name} should be part {k + 1} of {count}, but its header says {says}")
    tensors = [info for part in parts for info in part.tensors]
    _check_each_tensor_once(tensors, parts[0].metadata.get(SPLIT_TENSORS))
    return GGUFLayout(parts[0].metadata, tensors, files)


def gguf_split_parts(path: Path) -> list[Path]:
    """The model's files, checked as read_gguf_layout checks them: [path] for a single file,
    or every part of the split model `path` is a part of, the first (the metadata) first."""
    return read_gguf_layout(path).files


def _part_files(path: Path, split_no: int, count: int) -> list[Path]:
    """A split model's parts, found beside part `split_no` (0-based) by llama.cpp's names."""
    name = _PART_NAME.fullmatch(path.name)
    if name is None or (int(name["no"]), int(name["count"])) != (split_no + 1, count):
        raise ValueError(f"split GGUF: {path.name} is part {split_no + 1} of {count} of a split model, but its "
                         f"name is not PREFIX-{split_no + 1:05d}-of-{count:05d}.gguf, so its other parts "
                         "cannot be found")
    files = [path.with_name(f"{name['prefix']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise ValueError(f"split GGUF: {', '.join(missing)} not found in {path.parent} (the model is in "
                         f"{count} parts, all needed side by side)")
    return files


def _read_part(file: Path) -> GGUFLayout:
    try:
        return _read(file, with_tensors=True)
    except GGUFHeaderError as e:
        raise GGUFHeaderError(f"{file.name}: {e}") from None


def _check_each_tensor_once(tensors: list[TensorInfo], expected: object) -> None:
    seen: dict[str, Path] = {}
    for info in tensors:
        if info.name in seen:
            raise ValueError(f"split GGUF: tensor {info.name!r} is in both {seen[info.name].name} and {info.file.name}")
        seen[info.name] = info.file
    if len(tensors) != expected:
        raise ValueError(f"split GGUF: the parts hold {len(tensors)} tensors, but {SPLIT_TENSORS} says {expected}")


def _read(path: Path, with_tensors: bool) -> GGUFLayout:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise GGUFHeaderError("not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _layout(data, with_tensors, path)
        except (struct.error, UnicodeDecodeError, OverflowError):
            raise GGUFHeaderError("a truncated or corrupt GGUF header") from None


def _layout(data: mmap.mmap, with_tensors: bool, path: Path) -> GGUFLayout:
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
        return GGUFLayout(values, [], [path])
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
    tensors = [TensorInfo(name, dims, kind, data_start + start, path) for name, dims, kind, start in infos]
    return GGUFLayout(values, tensors, [path])


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
