"""Structured output on the engine's side: the compile cache and per-sample matchers
(`manager`); constraints, the grammar-library interface and its llguidance implementation
are common.structured_output's, which the frontend shares. docs/api.md shows the APIs.
"""
