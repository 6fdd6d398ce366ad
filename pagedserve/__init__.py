"""The pagedserve command line."""
