"""gRPC client helpers shared by the end-to-end tests: requests, collected streams, waits."""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.v1 import embedding_pb2 as emb, generation_pb2 as gen, info_pb2, tokenization_pb2 as tok

FR = gen.FinishReason
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GENERATION = "pagedserve.v1.Generation"
EMBEDDING = "pagedserve.v1.Embedding"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 2048  # conftest's ENGINE_FLAGS
# ~20 s of decoding on this CPU: a request that is gone within a few seconds was aborted.
LONG = dict(temperature=0, max_tokens=400, ignore_eos=True)
STORY = "Once upon a time, in a small village,"  # 10 tokens (no full KV block: no prefix-cache hit)


@dataclass
class Result:
    messages: list[gen.GenerateResponse]
    started: gen.Started
    finished: dict[int, gen.Finished]
    tokens: dict[int, list[int]]
    texts: dict[int, str]
    chunks: dict[int, list[gen.Chunk]]


def collect(messages: list[gen.GenerateResponse]) -> Result:
    """Checks the stream's shape: one Started first, then Chunks, each sample's Finished after
    its last Chunk, and the stream ends with a Finished."""
    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds and kinds[0] == "started", kinds
    assert kinds.count("started") == 1, kinds
    assert kinds[-1] == "finished", kinds
    finished: dict[int, gen.Finished] = {}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    chunks: dict[int, list[gen.Chunk]] = {}
    for m in messages[1:]:
        if m.HasField("chunk"):
            c = m.chunk
            assert c.index not in finished, f"chunk for sample {c.index} after its Finished"
            tokens.setdefault(c.index, []).extend(c.token_ids)
            texts[c.index] = texts.get(c.index, "") + c.text
            chunks.setdefault(c.index, []).append(c)
        else:
            assert m.HasField("finished"), m
            assert m.finished.index not in finished, f"two Finished for sample {m.finished.index}"
            finished[m.finished.index] = m.finished
    for i, f in finished.items():
        tokens.setdefault(i, [])
        texts.setdefault(i, "")
        assert f.usage.completion_tokens == len(tokens[i]), (f, tokens[i])
        assert f.usage.prompt_tokens == messages[0].started.prompt_tokens
    return Result(messages, messages[0].started, finished, tokens, texts, chunks)


def request(request_id: str = "", **kwargs) -> gen.GenerateRequest:
    return gen.GenerateRequest(request_id=request_id, **kwargs)


def greedy(max_tokens: int, **kwargs) -> gen.SamplingParams:
    return gen.SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def generate(fe, timeout: float = 120, **kwargs) -> Result:
    return collect(list(fe.generation.Generate(request(**kwargs), timeout=timeout)))


def embed_request(*inputs: str | list[int], **kwargs) -> emb.EmbedRequest:
    """An EmbedRequest of texts and token-id lists, in that order."""
    items = [emb.EmbedInput(text=i) if isinstance(i, str) else emb.EmbedInput(token_ids=gen.TokenIds(ids=i))
             for i in inputs]
    return emb.EmbedRequest(inputs=items, **kwargs)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """A unary call that must fail; returns its error."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def cancel(call) -> None:
    """Cancel a streaming call; its iteration must then end with CANCELLED."""
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.CANCELLED


def user(text: str) -> gen.Chat:
    return gen.Chat(messages=[gen.ChatMessage(role="user", content=text)])


def detokenize(fe, ids, **kwargs) -> str:
    return fe.tokenization.Detokenize(tok.DetokenizeRequest(token_ids=ids, **kwargs), timeout=10).text


def generate_error(fe, req: gen.GenerateRequest, timeout: float = 30) -> grpc.RpcError:
    """Generate must fail before sending any message; returns the error."""
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for message in fe.generation.Generate(req, timeout=timeout):
            received.append(message)
    assert not received, f"messages before the error {info.value.code()}: {received}"
    return info.value


def names_field(details: str, field: str) -> bool:
    return re.search(rf"(?<![A-Za-z_]){re.escape(field)}(?![A-Za-z_])", details) is not None


class Background:
    """A Generate stream read by a thread; `first_chunk` is set once a token arrived."""

    def __init__(self, fe, req: gen.GenerateRequest, timeout: float | None = None) -> None:
        self.call = fe.generation.Generate(req, timeout=timeout)
        self.messages: list[gen.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self.first_chunk = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
                if message.HasField("chunk"):
                    self.first_chunk.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def wait_first_chunk(self, timeout_s: float = 60) -> None:
        assert self.first_chunk.wait(timeout_s), f"no token within {timeout_s}s: {self.error}"

    def join(self, timeout_s: float = 30) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"


def token_offsets(fe, ids: list[int]) -> list[int]:
    """offsets[i] = length of the text of the first i tokens."""
    return [len(detokenize(fe, ids[:i])) for i in range(len(ids) + 1)]


def stop_across(fe, ids: list[int], first_boundary: int) -> tuple[str, int]:
    """A stop string made of the last 2 characters of one token and the first 2 of the next
    (so it spans two tokens), at a boundary >= first_boundary, whose first occurrence in the
    text is there. Returns (stop string, its position in the text)."""
    text = detokenize(fe, ids)
    offsets = token_offsets(fe, ids)
    for b in range(first_boundary, len(ids) - 1):
        left, here, right = offsets[b - 1], offsets[b], offsets[b + 1]
        if here - left >= 2 and right - here >= 2:
            stop = text[here - 2:here + 2]
            if text.find(stop) == here - 2 and stop.strip():
                return stop, here - 2
    raise AssertionError(f"no boundary to split a stop string over in {text!r}")


def wait_info(fe, predicate, timeout_s: float = 5) -> info_pb2.ServerInfo:
    """GetServerInfo until predicate holds (stats of other frontends' requests arrive with the
    heartbeat); returns the last one either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = fe.server_info()
        if predicate(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def port_is_free(port: int) -> bool:
    """Nothing listens on it (connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
