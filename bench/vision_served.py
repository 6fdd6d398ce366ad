"""bench/vision.py's prefix hit over HTTP: `pagedserve serve` on the model, a streamed
/v1/chat/completions per request with the image as a JPEG data URL (made before the clock
starts), TTFT the first chunk with text or a finish. Per run a new image (its first request
misses; the system prompt's block may hit), then the same image with the other question."""

from __future__ import annotations

import base64
import io
import json
import time

from bench import vision_report as report
from bench.openai_client import error_body, sse_data
from bench.vision_model import MAX_MODEL_LEN, QUESTIONS, picture


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(model: str, url: str, question: str) -> dict:
    """One streamed chat turn, the image then the question, for exactly 1 output token."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def first_token_s(events: list[tuple[float, dict]]) -> float | None:
    """The arrival of the first chunk with text or a finish reason, among (time, event)."""
    for at, event in events:
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
                return at
    return None


def chat_ttft(client, model: str, url: str, question: str) -> tuple[float, dict]:
    """(TTFT in s, the final usage) of one request; RuntimeError when it fails."""
    events = []
    start = time.perf_counter()
    with client.stream("POST", "chat/completions", json=chat_body(model, url, question)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {error_body(response.read())}")
        for line in response.iter_lines():
            data = sse_data(line)
            if data is None or data.strip() == "[DONE]":
                continue
            events.append((time.perf_counter() - start, json.loads(data)))
    errors = [e["error"] for _, e in events if "error" in e]
    ttft = first_token_s(events)
    if errors or ttft is None:
        raise RuntimeError(f"chat completion failed: {errors or 'no token came'}")
    usage = next((e["usage"] for _, e in reversed(events) if e.get("usage")), {})
    return ttft, usage


def measure_served(folder, args, bar) -> tuple[list[dict], list[dict]]:
    """(a hit_row per size measured over HTTP, the sizes that failed: size, error, the server's
    last lines). After a failure the server may be gone: the larger sizes are not tried."""
    import httpx

    from bench.servers import server_for
    from engine.config import EngineConfig
    config = EngineConfig.from_kwargs(model=str(folder), dtype=args.dtype, max_model_len=MAX_MODEL_LEN,
                                      num_threads=args.num_threads)
    bar.set_description("starting pagedserve serve")
    server = server_for("pagedserve", config, max_concurrent_streams=4)
    server.start()
    rows, errors = [], []
    try:
        with httpx.Client(base_url=f"{server.http_url}/v1/", trust_env=False, timeout=600) as client:
            model = client.get("models").json()["data"][0]["id"]
            for size in args.sizes:
                bar.set_description(f"HTTP hit {size}px")
                try:
                    rows.append(served_hits(client, model, size, args.repeats, bar))
                except (RuntimeError, httpx.HTTPError) as e:
                    errors.append({"size": size, "error": str(e), "server_tail": list(server.tail)[-5:]})
                    break
    finally:
        server.stop()
    return rows, errors


def served_hits(client, model: str, size: int, repeats: int, bar) -> dict:
    """Per run a new image's first request (the miss), then the same image with the other
    question (the hit); run 0 a warm-up."""
    miss_s, hit_s, usage = [], [], {}
    for run in range(repeats + 1):
        url = data_url(picture(size, 2000 * size + run))
        miss, _ = chat_ttft(client, model, url, QUESTIONS[0])
        hit, usage = chat_ttft(client, model, url, QUESTIONS[1])
        if run:
            miss_s.append(miss)
            hit_s.append(hit)
        bar.update()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return report.hit_row("http", size, miss_s, hit_s, cached, usage.get("prompt_tokens", 0), None)
