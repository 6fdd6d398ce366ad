"""Python stubs generated from protos/pagedserve/v1 by `make protos` (protos/generate.py). Do not edit."""
