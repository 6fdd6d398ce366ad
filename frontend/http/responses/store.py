"""Stored responses (store=true): this frontend process's memory, bounded two ways.

    --response-store-size  at most this many; the least recently used (created, read or
                           continued) is dropped first
    --response-ttl-s       each for at most this long after its creation

Each keeps its Response object and the conversation that led to it (the items of its prompt,
then its output), which previous_response_id continues. A background response still running
is here too, with its task: dropping it (evicted, expired or deleted) cancels the task, which
aborts its engine request. Only the frontend's one event loop touches the store: no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import InvalidRequest
from frontend.http.errors import not_found
from frontend.http.responses.items import Item


@dataclass
class Stored:
    body: dict  # the Response object, as GET returns it
    conversation: list[Item]
    expires: float
    task: asyncio.Task | None = None  # a background response's run, until it ends

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()


class ResponseStore:
    def __init__(self, size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.ttl_s, self.clock = size, ttl_s, clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()  # least recently used first
        self.expiry: deque[tuple[float, str]] = deque()  # (expires, id) in creation order: expiry order too

    def put(self, body: dict, conversation: list[Item], task: asyncio.Task | None = None) -> Stored:
        """Keep a response (size 0: nothing is kept; the caller refuses background then)."""
        stored = Stored(body, conversation, self.clock() + self.ttl_s, task)
        self._expire()
        if self.size > 0:
            self.entries[body["id"]] = stored
            self.expiry.append((stored.expires, body["id"]))
            while len(self.entries) > self.size:
                self._drop(next(iter(self.entries)))
            if len(self.expiry) > 2 * self.size:  # mostly ids dropped already: rebuild it from what is kept
                self.expiry = deque(sorted((s.expires, i) for i, s in self.entries.items()))
        return stored

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        """The stored response, now the most recently used; 404 naming the id if there is none."""
        self._expire()
        stored = self.entries.get(response_id)
        if stored is None:
            where = "" if param == "response_id" else f"{param}: "
            raise not_found(f"{where}Response with id {response_id!r} not found (responses are kept in the memory "
                            "of the frontend that served them, for a limited time)", param)
        self.entries.move_to_end(response_id)
        return stored

    def conversation(self, response_id: str | None) -> list[Item]:
        """The items a request with previous_response_id continues: that response's prompt
        and output (not its instructions, as OpenAI does)."""
        if response_id is None:
            return []
        stored = self.get(response_id, "previous_response_id")
        if stored.running:
            raise InvalidRequest(f"previous_response_id: response {response_id!r} is still "
                                 f"{stored.body['status']}; wait until it has ended")
        return stored.conversation

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        stored = self.entries.pop(response_id)
        if stored.running:
            stored.task.cancel()

    def _expire(self) -> None:
        now = self.clock()
        while self.expiry and self.expiry[0][0] <= now:
            _, response_id = self.expiry.popleft()
            if response_id in self.entries:  # not dropped already
                self._drop(response_id)
