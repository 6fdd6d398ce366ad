"""Python stubs generated from protos/pagedserve/v1 by `make protos`. Do not edit."""
