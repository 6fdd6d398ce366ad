"""Our GGUF header reader (engine/models/gguf_header.py, stdlib) and the loader's tensor views
over it, against gguf-py's GGUFReader on the bundled file: the same metadata values, and
every tensor's name, type, shape and bytes."""

from __future__ import annotations

import numpy as np


def test_the_loaders_view_of_the_file_is_gguf_pys(bundled_path):
    import gguf

    from engine.models.gguf_header import read_gguf_header
    from engine.models.gguf_loader import _gguf
    theirs = gguf.GGUFReader(str(bundled_path))
    ours = _gguf(bundled_path)
    scalars = {key: field.contents() for key, field in theirs.fields.items()
               if field.types and field.types[0] != gguf.GGUFValueType.ARRAY and not key.startswith("GGUF.")}
    assert ours.metadata == read_gguf_header(bundled_path) == scalars
    assert "tokenizer.ggml.tokens" not in ours.metadata  # the vocabulary is not read
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(reference.shape.tolist()), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
