"""Iteration-level scheduler: which tokens of which requests run in the next step.

Every request has `num_computed_tokens` (KV in the cache) catching up with
`num_tokens` (prompt + outputs). Each step hands out at most
`max_num_batched_tokens`: running requests first (decodes and unfinished
prefill chunks), then waiting ones in priority/arrival order. A prompt longer
than what is left of the budget is chunked. When the KV pool runs dry, the
newest (lowest-priority) running request is preempted by recompute.

With speculative decoding a decoding request carries draft tokens (`spec_token_ids`, set by
the proposer after the previous step): they are scheduled with its last token, count against the
budget, and get KV slots; rejected ones are rolled back by lowering `num_computed_tokens`, their
slots written again later. Drafts are never given to the block manager's hashing.

A request that only decodes (one token a step, no drafts) is a steady decode, scheduled and
updated by C loops (engine/steady_decodes.py, the `SteadyDecodes` half of the scheduler).

A request with structured output first waits in `waiting_for_grammar` while its grammar
compiles in a worker thread; each `schedule()` moves the compiled ones into the queue, so the
step loop never waits for a compile.
"""

from __future__ import annotations

import heapq
import time

from common.errors import InvalidRequest
from common.multimodal import whole_image_end
from common.outputs import EngineCoreOutput, PlainTokens, sample_request_id
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.stats import IterationStats, SpecDecodingStats
from engine.steady_decodes import SteadyDecodes, _decode_entry, _request, _spec_token_ids


class Scheduler(SteadyDecodes):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 stats: IterationStats | None = None) -> None:
        self.config = config
        self.stats = stats  # None: nobody reads metrics, so collect none (the offline LLM)
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}  # every unfinished request, by request id
        self.waiting: list[tuple[tuple[int, int, int], Request]] = []  # heap on the sort key
        self.running: list[Request] = []
        self.waiting_for_grammar: list[Request] = []
        # Requests that ended outside a step's update (a grammar that did not compile): their
        # last outputs go out with the next step's.
        self.failed_outputs: list[EngineCoreOutput] = []
        self.finished_request_ids: set[str] = set()
        self.num_finished = 0  # requests ended so far (SchedulerOutput.num_finished)
        self._appended: set[str] = set()  # running requests this step scheduled via append_slots (not a lease)
        self.num_preemptions = 0  # total since start, for metrics
        self.spec_stats = SpecDecodingStats()  # totals since start, for metrics

    # -- admission ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        if request.structured is not None and not request.structured.grammar.done():
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
        else:
            self._queue_with_grammar(request)

    def remove_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Take requests out wherever they are, free their blocks, mark them finished."""
        removed = [self.requests[r] for r in request_ids if r in self.requests]
        gone = {id(r) for r in removed}
        if not gone:
            return []
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting_for_grammar = [r for r in self.waiting_for_grammar if id(r) not in gone]
        self.waiting = [e for e in self.waiting if id(e[1]) not in gone]
        heapq.heapify(self.waiting)
        for request in removed:
            self._finish(request, status)
        return removed

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        """Queued, or waiting for their grammar to compile."""
        return len(self.waiting) + len(self.waiting_for_grammar)

    # -- scheduling --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._take_compiled()
        out = SchedulerOutput(finished_request_ids=self.finished_request_ids)
        self.finished_request_ids = set()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.num_preempted:  # after a preemption the pool is too tight to admit more
            self._schedule_waiting(out, budget)
        out.blocks_to_copy = self._live_copies(out)
        out.kv_saves, out.kv_restores = self.block_manager.take_offload_copies()
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.num_finished = self.num_finished
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # The hot loop of a decode step. A steady decode (one token, no drafts) holding a lease
        # from the block manager (BlockManager.decode_lease) only appends its standing entry;
        # the others take the general path, `_schedule_one`. When every running request is a
        # steady decode, as in most steps, the loop over them runs in C (map over attrgetters):
        # those whose lease is spent (a block filled: with staggered requests a few every step)
        # renew it first, in running order, so the rows keep their order from step to step
        # (engine/block_tables.py then skips its lookups). The steady ones go first in
        # out.scheduled (out.num_steady of them), for the runner.
        running = self.running
        self._appended.clear()
        if len(running) <= budget and not any(map(_spec_token_ids, running)) and self._all_leased(running):
            steady = list(map(_decode_entry, running))
            out.steady_requests = running[:]
            budget -= len(steady)
        else:  # (a renewal that failed above left the rest to this loop; those renewed count as leased)
            steady = []
            for request in list(running):
                if budget <= 0:
                    break
                if request.num_computed_tokens < request.decode_lease_end and not request.spec_token_ids:
                    steady.append(request.decode_entry)
                    budget -= 1
                elif request.status == RequestStatus.RUNNING and self._renew_steady(request):
                    steady.append(request.decode_entry)
                    budget -= 1
                elif request.status == RequestStatus.RUNNING:  # else preempted earlier in this loop
                    budget = self._schedule_one(request, out, steady, budget)
            out.steady_requests = list(map(_request, steady))
        out.scheduled[:0] = steady
        out.num_steady = len(steady)
        return budget

    def _schedule_one(self, request: Request, out: SchedulerOutput, steady: list[ScheduledRequest],
                      budget: int) -> int:
        """A running request's share of the step through the block manager (preempting
        others, or itself, when blocks run short); then a decode lease for the next steps."""
        lookahead = self.config.num_lookahead_tokens
        computed = request.num_computed_tokens
        num_new = min(len(request.all_token_ids) - computed, budget)
        if request.whole_images:
            num_new = whole_image_end(request.images, computed, computed + num_new) - computed
            if num_new == 0:  # the next image does not fit what is left of this step
                return budget
        # Drafts follow a decode's one token, as far as the budget goes.
        drafts = request.spec_token_ids[:max(0, budget - num_new)] if request.spec_token_ids else ()
        if drafts and request.structured is not None and request.structured.waiting:
            drafts = request.structured.drafts_before_start(request.all_token_ids, drafts)
        num_new += len(drafts)
        end = self._slots(computed + num_new) if lookahead else computed + num_new
        while not self.block_manager.append_slots(request.request_id, request.all_token_ids, end, computed):
            victim = max(self.running, key=self._order)
            budget += self._preempt(victim, out, steady)
            if victim is request:
                return budget
        self._appended.add(request.request_id)
        entry = self._scheduled(request, num_new, drafts)
        request.decode_lease_end = 0
        if num_new == 1 and entry.num_samples == 1 and not drafts and request.output_token_ids:
            steady.append(entry)  # a decode: it stays one until it finishes or gets drafts
            request.decode_entry = entry
            if not lookahead:  # a draft model's lookahead slots take the general path
                request.decode_lease_end = self.block_manager.decode_lease(request.request_id)
        else:
            out.scheduled.append(entry)
        return budget - num_new

    def _slots(self, end: int) -> int:
        """Tokens the table must cover when this step computes up to `end`: with a draft model,
        k more for the drafts it writes ahead (never past max_model_len)."""
        return min(end + self.config.num_lookahead_tokens, max(end, self.config.max_model_len))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Requests for an adapter that would make the running set mix more than max_loras
        # step aside (others may pass them); they go back in the queue afterwards.
        adapters = {r.lora_name for r in self.running if r.lora_name}
        skipped = []
        seats = sum(r.num_seats for r in self.running) if self.waiting else 0
        while self.waiting and budget > 0:
            request = self.waiting[0][1]
            if self.running and seats + request.num_seats > self.config.max_num_seqs:
                break
            if request.lora_name and request.lora_name not in adapters and len(adapters) >= self.config.max_loras:
                skipped.append(heapq.heappop(self.waiting))
                continue
            cached_blocks, num_cached = [], 0
            if not request.needs_prompt_logprobs:  # else every prompt position must run, as in vLLM
                cached_blocks, num_cached = self.block_manager.get_computed_blocks(
                    request.all_token_ids, request.block_extra_keys)
            num_new = min(request.num_tokens - num_cached, budget)
            if request.whole_images:
                num_new = whole_image_end(request.images, num_cached, num_cached + num_new) - num_cached
                if num_new == 0:
                    break  # its next image waits for a step with room for all of it
            if request.pooling is not None and num_new < request.num_tokens - num_cached:
                break  # a pooling prompt runs whole (it fits the budget: EngineCore checks); next step
            if not self.block_manager.allocate(request.request_id, request.all_token_ids,
                                               self._slots(num_cached + num_new), cached_blocks,
                                               request.block_extra_keys, num_cached):
                break  # the head waits for blocks; nobody overtakes it
            heapq.heappop(self.waiting)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += request.num_seats
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            if request.lora_name:
                adapters.add(request.lora_name)
        for entry in skipped:
            heapq.heappush(self.waiting, entry)

    def _take_compiled(self) -> None:
        if not self.waiting_for_grammar:
            return
        # One look per future: a compile that finishes meanwhile waits for the next step.
        ready, still = [], []
        for request in self.waiting_for_grammar:
            (ready if request.structured.grammar.done() else still).append(request)
        self.waiting_for_grammar = still
        for request in ready:
            request.status = RequestStatus.WAITING
            self._queue_with_grammar(request)

    def _queue_with_grammar(self, request: Request) -> None:
        """Queue a request whose grammar (if any) has compiled; one that failed ends here."""
        if request.structured is not None:
            try:
                request.structured.start(request.prompt_token_ids)
            except InvalidRequest as e:
                request.error = str(e)
                self._finish(request, RequestStatus.FINISHED_INVALID)
                self.failed_outputs.append(self._output(request, [], [], None))
                return
        self._push_waiting(request)

    def take_failed_outputs(self) -> list[EngineCoreOutput]:
        taken, self.failed_outputs = self.failed_outputs, []
        return taken

    # -- update ------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                           plain: PlainTokens | None = None) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled ones, fork n>1 prompts, finish stopped
        requests. With `plain`, the steady decodes' plain tokens go there (PlainTokens),
        not into the returned outputs."""
        num_steady = len(result.steady_token_ids)
        now = time.monotonic()
        outputs = self._append_steady(sched.steady_requests[:num_steady], result, now, plain,
                                      ended=sched.num_finished != self.num_finished)
        drafted = {}
        for s in sched.scheduled[num_steady:]:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            if request.spec_token_ids:
                request.spec_token_ids = []  # verified now; the proposer gives new ones
            if s.spec_token_ids:
                drafted[request.request_id] = s
        for request_id, entries in result.prompt_logprobs.items():
            self.requests[request_id].prompt_logprobs += entries
        if result.pooled:
            outputs += self._finish_pooled(result.pooled)
        for request_id, tokens, logprobs in zip(result.request_ids, result.token_ids, result.logprobs):
            request = self.requests[request_id]
            if drafted and request_id in drafted:
                self._rollback(drafted[request_id], num_accepted=len(tokens) - 1)
            if request.needs_fork:  # n tokens: one for each of the n samples
                samples = [request] + self._fork(request, len(tokens) - 1)
                for sample, token, lp in zip(samples, tokens, logprobs):
                    outputs.append(self._append_run(sample, [token], [lp], now))
            else:  # one token, or with drafts the accepted ones and one more
                outputs.append(self._append_run(request, tokens, logprobs, now))
        if any(o.finish_reason is not None for o in outputs):  # one pass, not a list.remove each
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt ran: each ends with its vector, its blocks freed."""
        outputs = []
        for request_id, vector in pooled.items():
            request = self.requests[request_id]
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            out = self._output(request, [], [], None)
            out.pooled = vector
            outputs.append(out)
        return outputs

    def _rollback(self, s: ScheduledRequest, num_accepted: int) -> None:
        """Rejected drafts' KV is not the sequence's: step back before them."""
        s.num_accepted_tokens = num_accepted
        s.request.num_computed_tokens -= len(s.spec_token_ids) - num_accepted
        self.spec_stats.observe(len(s.spec_token_ids), num_accepted)

    def _append_run(self, request: Request, tokens: list[int], logprobs: list, now: float) -> EngineCoreOutput:
        """Append tokens in order until one stops the request (the rest are dropped)."""
        prompt_logprobs = (self._take_prompt_logprobs(request)
                           if request.sampling_params.prompt_logprobs is not None else None)
        emitted = 0
        for token, token_logprobs in zip(tokens, logprobs):
            if self.stats is not None:
                self.stats.observe_token(request, now, first_of_step=emitted == 0)
            request.last_token_time = now
            request.append_output(token, token_logprobs)
            emitted += 1
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
                break
        if emitted < len(tokens):
            tokens, logprobs = tokens[:emitted], logprobs[:emitted]
        return self._output(request, tokens, logprobs, prompt_logprobs)

    @staticmethod
    def _output(request: Request, tokens: list[int], logprobs: list[dict[int, float] | None],
                prompt_logprobs: list | None) -> EngineCoreOutput:
        status = request.status
        # Positional: a slots dataclass built from keywords costs 3x as much, once per
        # request per step.
        return EngineCoreOutput(
            request.caller_id, request.sample_index, tokens,
            None if not logprobs or logprobs[0] is None else logprobs,
            None if status == RequestStatus.RUNNING else status.finish_reason, request.stop_token_id,
            len(request.prompt_token_ids), request.num_cached_tokens, prompt_logprobs,
            None if prompt_logprobs is None else request.prompt_token_ids, request.error)

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list[dict[int, float] | None] | None:
        """The whole prompt's entries, for the output carrying the request's first token."""
        if not request.needs_prompt_logprobs:
            return None
        if len(request.prompt_logprobs) != request.num_prompt_tokens - 1:
            raise RuntimeError(f"{request.request_id}: {len(request.prompt_logprobs)} prompt logprobs "
                               f"for a {request.num_prompt_tokens}-token prompt")
        entries, request.prompt_logprobs = [None, *request.prompt_logprobs], []
        return entries

    def _fork(self, parent: Request, count: int) -> list[Request]:
        """Siblings 1..count of an n>1 prompt, sharing its blocks copy-on-write."""
        siblings = []
        parent.decode_lease_end = 0  # its last block is shared from here on: no lease
        for index in range(1, count + 1):
            child = Request(
                request_id=sample_request_id(parent.parent_id, index),
                prompt_token_ids=parent.prompt_token_ids, sampling_params=parent.sampling_params,
                eos_token_ids=parent.eos_token_ids, priority=parent.priority,
                arrival_time=parent.arrival_time, arrival_seq=parent.arrival_seq,
                parent_id=parent.parent_id, sample_index=index, status=RequestStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens, num_cached_tokens=parent.num_cached_tokens,
                scheduled_time=parent.scheduled_time, lora_name=parent.lora_name,
                block_extra_keys=parent.block_extra_keys, images=parent.images,
                rope_table=parent.rope_table, rope_delta=parent.rope_delta, whole_images=parent.whole_images,
                structured=None if parent.structured is None else parent.structured.fork())
            self.block_manager.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self.running.append(child)
            siblings.append(child)
        return siblings

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.structured is not None:
            matcher = request.structured.matcher
            if matcher is None:  # still reasoning: the grammar begins after its end (starts_after)
                request.structured.watch(request.all_token_ids)
            elif not matcher.accept(token):
                return self._grammar_failed(request, token)
            elif matcher.is_terminated():  # the grammar is complete: that is the end, eos or not
                if matcher.error():  # no: it found no token to go on with, and allowed only eos
                    return self._grammar_failed(request, token)
                if token in request.eos_token_ids or token in params.stop_token_ids:
                    request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens and (
                (not params.ignore_eos and token in request.eos_token_ids)
                or (params.stop_token_ids and token in params.stop_token_ids)):
            request.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _grammar_failed(request: Request, token: int) -> RequestStatus:
        """Its matcher refused `token`, or ended with it in its error state (it found no token
        to go on with, and allowed only eos). Where the vocabulary cannot write the grammar,
        the caller's to fix (FINISHED_INVALID); else the engine's fault (FINISHED_ERROR)."""
        request.error = request.structured.failure(request.all_token_ids)
        if request.error is not None:
            return RequestStatus.FINISHED_INVALID
        reason = request.structured.matcher.error().strip().partition("\n")[0] or "no reason given"
        request.error = f"structured output: the grammar rejected sampled token {token} ({reason})"
        return RequestStatus.FINISHED_ERROR

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledRequest:
        reaches_end = request.num_computed_tokens + num_new - len(drafts) == len(request.all_token_ids)
        n = request.sampling_params.n
        num_samples = 0 if not reaches_end or request.pooling else n if n > 1 and request.needs_fork else 1
        return ScheduledRequest(request, num_new, self.block_manager.live_block_table(request.request_id),
                                num_samples, list(drafts) if drafts else [])

    def _preempt(self, victim: Request, out: SchedulerOutput, steady: list[ScheduledRequest]) -> int:
        """Free the victim's blocks and requeue it; returns budget given back."""
        # Where this step already scheduled it, if it did: (list, index).
        taken_back = next(((entries, k) for entries in (steady, out.scheduled)
                           for k, s in enumerate(entries) if s.request is victim), None)
        # Was it scheduled through the block manager this step (not on its lease)? Then blocks
        # that call filled were cached, but their KV will never be written: uncache them.
        discarded = taken_back is not None and victim.request_id in self._appended
        victim.decode_lease_end = 0  # its lease ends with its blocks
        self.running.remove(victim)
        self.block_manager.free(victim.request_id, step_discarded=discarded)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.prompt_logprobs = []  # its recompute scores the prompt again from position 1
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.num_preempted += 1
        self._push_waiting(victim)
        if taken_back is None:
            return 0
        entries, k = taken_back
        return entries.pop(k).num_new_tokens  # give its budget back

    def preempt_all(self) -> int:
        """Preempt every running request, newest first (sleep, a weight update: engine/sleep.py):
        each gives its blocks back and waits to recompute, so no request holds KV. Returns how many."""
        out = SchedulerOutput()
        for victim in reversed(self.running[:]):
            self._preempt(victim, out, [])
        return out.num_preempted

    def _live_copies(self, out: SchedulerOutput) -> list[tuple[int, int]]:
        # A copy into a block that a preempted request gave back is moot.
        copies = self.block_manager.take_blocks_to_copy()
        if not copies:
            return copies
        live = {b for s in out.scheduled for b in s.block_ids}
        return [(src, dst) for src, dst in copies if dst in live]

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self.waiting, (self._order(request), request))

    def _order(self, request: Request) -> tuple[int, int, int]:
        """Who goes first (smallest) and who is preempted first (largest)."""
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_seq, request.sample_index)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.num_finished += 1
        # Its standing entry refers back to it: a cycle that only the cyclic GC would free, in
        # a full collection (the request had lived long enough to reach the oldest generation).
        request.decode_entry = None
        if self.stats is not None:
            self.stats.observe_finished(request, time.monotonic())
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]
        self.finished_request_ids.add(request.request_id)
