"""Running admitted generations for the HTTP routes: to completion, or merged into one stream,
and cancelled when the client goes away (which stops them in the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request

from frontend.async_llm import AsyncLLM, Generation
from frontend.output_processor import PositionLogprobs, SampleDelta

_DONE = object()


@dataclass
class SampleResult:
    """One sample's whole output, gathered from its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


async def run_to_end(llm: AsyncLLM, generations: list[Generation]) -> list[list[SampleResult]]:
    """Each generation's samples, complete."""
    async def one(generation: Generation) -> list[SampleResult]:
        results = [SampleResult(i) for i in range(generation.state.params.n)]
        async for deltas in llm.generate(generation):
            for delta in deltas:
                results[delta.index].add(delta)
        return results
    tasks = [asyncio.ensure_future(one(g)) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # one failed, or we were cancelled: stop the others too
            task.cancel()


async def merged(llm: AsyncLLM, generations: list[Generation]
                 ) -> AsyncIterator[tuple[int, list[SampleDelta]]]:
    """(which generation, its deltas) as they come from all of them."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, generation: Generation) -> None:
        try:
            async for deltas in llm.generate(generation):
                queue.put_nowait((i, deltas))
            queue.put_nowait(_DONE)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which reports it
            queue.put_nowait(e)
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or cancel it when the client disconnects first (a non-streaming call
    would otherwise run to its end for nobody, holding KV blocks)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return task.result()
