"""A split GGUF (llama.cpp's gguf-split, or gguf-py's GGUFWriter with split_max_tensors, as
convert_hf_to_gguf.py --split-max-tensors writes it: PREFIX-0000k-of-0000N.gguf): the bundled
SmolLM2 rewritten by gguf-py's own tools into 3 parts, every key-value and tensor as stored.
Any part names the model; the engine loads every part, mapped, and generates what the single
file does; a missing or mismatched part is a clear error naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers import split_gguf
from pagedserve import LLM, SamplingParams

NUM_PARTS = 3


@pytest.fixture(scope="module")
def parts(tmp_path_factory, bundled_path) -> list[Path]:
    files = split_gguf(bundled_path, tmp_path_factory.mktemp("split") / "SmolLM2.gguf", NUM_PARTS)
    assert [f.name for f in files] == [f"SmolLM2-{k:05d}-of-{NUM_PARTS:05d}.gguf" for k in (1, 2, 3)]
    return files


def _folder_with(tmp_path: Path, files: dict[str, Path]) -> Path:
    """A folder holding `files` (by their new names), hard-linked: no copy of the bytes."""
    for name, source in files.items():
        os.link(source, tmp_path / name)
    return tmp_path


def _mapped_file(array: np.ndarray) -> Path:
    """The file `array` is a view of (an AttributeError if it is not a view of a mapped file)."""
    while not isinstance(array, np.memmap):
        array = array.base
    return Path(array.filename)


def test_split_model_generates_what_the_single_file_does(parts, bundled_path):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = [[o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", num_kv_blocks=32)
                .generate(prompts, params)] for path in (bundled_path, parts[0])]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 8 for tokens in outputs[0])


def test_any_part_names_the_model_and_each_tensor_is_a_view_of_its_part(parts, bundled_path):
    from engine.models.gguf_header import gguf_split_parts
    from engine.models.gguf_loader import _gguf, read_gguf_config
    assert all(gguf_split_parts(part) == parts for part in parts)
    assert gguf_split_parts(bundled_path) == [bundled_path]
    assert read_gguf_config(parts[2]) == read_gguf_config(bundled_path)
    single, split = _gguf(bundled_path), _gguf(parts[1])
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")} == single.metadata
    assert [t.name for t in split.tensors] == [t.name for t in single.tensors]
    files = set()
    for mine, reference in zip(split.tensors, single.tensors):
        assert (mine.tensor_type, mine.shape) == (reference.tensor_type, reference.shape), mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
        files.add(_mapped_file(mine.data))
    assert files == set(parts)


def test_a_missing_part_is_named(parts, tmp_path):
    folder = _folder_with(tmp_path, {parts[0].name: parts[0]})
    with pytest.raises(ValueError, match=f"{parts[1].name}, {parts[2].name}") as error:
        LLM(str(folder / parts[0].name), dtype="float32", num_kv_blocks=32)
    assert str(folder) in str(error.value)


def test_parts_that_do_not_fit_are_refused(parts, tmp_path):
    from engine.models.gguf_header import gguf_split_parts
    folder = _folder_with(tmp_path, {parts[0].name: parts[0], parts[1].name: parts[2], parts[2].name: parts[2]})
    with pytest.raises(ValueError, match=f"{parts[1].name} should be part 2 of 3, but its header says part 3 of 3"):
        gguf_split_parts(folder / parts[0].name)
    os.link(parts[0], folder / "model.gguf")  # renamed: its other parts cannot be found
    with pytest.raises(ValueError, match="model.gguf is part 1 of 3 of a split model, but its name is not"):
        gguf_split_parts(folder / "model.gguf")
