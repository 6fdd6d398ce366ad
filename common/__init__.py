"""What the frontend and the engine share, at the bottom of the layers (docs/architecture.md):
the generated stubs (`common.v1`), the engine socket's messages, errors, SamplingParams,
structured-output constraints, the prefix cache's block keys, tokenizer files and metrics
plumbing. It imports nothing else of pagedserve's, and never torch."""
