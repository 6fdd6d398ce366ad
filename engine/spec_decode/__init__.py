"""Speculative decoding: proposers that draft tokens and the bookkeeping that verifies them."""
