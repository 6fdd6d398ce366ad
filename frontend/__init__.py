"""The gRPC frontend: tokenization, validation, streaming, health (next issue)."""
