"""The frontend process: the gRPC and HTTP APIs (OpenAI, Anthropic) on one uvloop loop, the
input and output processors they share with the offline LLM (tokenizer, chat templates,
detokenization, stop strings), and AsyncLLM with its engine pool and router, which reach
the engines over ZeroMQ. It never imports torch (docs/architecture.md)."""
