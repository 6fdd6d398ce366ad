"""Reasoning parsers: the model's thinking (`<think>...</think>`) split from its answer."""
