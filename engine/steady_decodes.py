"""The steady decodes' half of the scheduler (`Scheduler` inherits it): their scheduling and
their update, the hot loop of every decode step.

A request that only decodes (one token a step, no drafts) is a steady decode: it holds a lease
from the block manager on the rest of its last block (`BlockManager.decode_lease`), and until
the lease is spent it is scheduled and updated without a call there, by C loops over the
running requests (`map` over attrgetters, numpy) where every one of them is such a decode.
A spent lease is renewed in short (`_renew_steady`), keeping the request's standing entry.
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import compress, repeat

import numpy as np

from common.outputs import EngineCoreOutput, PlainTokens
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus

_num_computed = operator.attrgetter("num_computed_tokens")
_lease_end = operator.attrgetter("decode_lease_end")
_spec_token_ids = operator.attrgetter("spec_token_ids")
_decode_entry = operator.attrgetter("decode_entry")
_request = operator.attrgetter("request")
_output_token_ids = operator.attrgetter("output_token_ids")
_all_token_ids = operator.attrgetter("all_token_ids")
_prompt_token_ids = operator.attrgetter("prompt_token_ids")
_length_limit = operator.attrgetter("length_limit")
_stop_candidates = operator.attrgetter("stop_candidates")
_structured = operator.attrgetter("structured")
_caller_id = operator.attrgetter("caller_id")
_sample_index = operator.attrgetter("sample_index")
_num_cached = operator.attrgetter("num_cached_tokens")
_status = operator.attrgetter("status")


def _consume(iterator) -> None:
    """Run an iterator of side effects (map over appends, setattr) to its end, in C."""
    deque(iterator, maxlen=0)


class SteadyDecodes:
    """Methods of `Scheduler` (engine/scheduler.py) for its steady decodes; they use its
    block manager, config, stats, `_appended`, `_check_stop`, `_finish` and `_output`."""

    def _all_leased(self, running: list[Request]) -> bool:
        """Whether every running request holds a lease for this step, renewing spent ones."""
        leased = list(map(operator.lt, map(_num_computed, running), map(_lease_end, running)))
        return all(leased) or all(map(self._renew_steady, compress(running, map(operator.not_, leased))))

    def _renew_steady(self, request: Request) -> bool:
        """A steady decode whose lease is spent (its last block full, 1 step in block_size):
        `_schedule_one`'s work for it in short, its entry kept. False: the general path
        decides (drafts, a draft model's lookahead, blocks short, not a steady decode)."""
        computed = request.num_computed_tokens
        if (request.spec_token_ids or self.config.num_lookahead_tokens
                or len(request.all_token_ids) != computed + 1 or not self._renew_lease(request, computed + 1)):
            return False
        self._appended.add(request.request_id)
        return True

    def _renew_lease(self, request: Request, end: int) -> bool:
        """Grow a steady decode's table to `end` tokens, its step writing KV at position
        `end - 1` (a step ahead: the position after the token in flight), and lease the new
        room; False (the general path decides) if blocks run short or it has no lease to renew
        (not a steady decode). Its entry (`decode_entry`) holds the live table, so it stays right."""
        if not request.decode_lease_end or request.decode_entry is None:
            return False
        if not self.block_manager.append_slots(request.request_id, request.all_token_ids, end, end - 1):
            return False
        request.decode_lease_end = self.block_manager.decode_lease(request.request_id)
        return request.decode_lease_end >= end

    def _append_steady(self, requests: list[Request], result: ModelRunnerOutput, now: float,
                       plain: PlainTokens | None, ended: bool = True) -> list[EngineCoreOutput]:
        """The steady decodes' one token each: `_append_run`'s work as C loops (map over the
        requests' lists and attributes), with the full stop check only for the few requests
        a cheap test says the token may end. The others' tokens go into `plain` if given.
        `ended`: whether requests may have ended since the step was scheduled."""
        tokens, logprobs = result.steady_token_ids, result.steady_logprobs
        if ended and not all(map(operator.is_, map(_status, requests), repeat(RequestStatus.RUNNING))):
            # A step scheduled ahead (engine/async_step.py) ran requests that ended (or were
            # aborted) with the step before: their tokens here are past the end, dropped.
            keep = [i for i, r in enumerate(requests) if r.status == RequestStatus.RUNNING]
            requests, tokens = [requests[i] for i in keep], [tokens[i] for i in keep]
            if logprobs is not None:
                logprobs = [logprobs[i] for i in keep]
        if self.stats is not None:  # (last_token_time is for the stats' inter-token latencies)
            self.stats.observe_decodes(requests, now)
            _consume(map(setattr, requests, repeat("last_token_time"), repeat(now)))
        _consume(map(list.append, map(_output_token_ids, requests), tokens))
        _consume(map(list.append, map(_all_token_ids, requests), tokens))
        _consume(map(setattr, requests, repeat("num_computed_tokens"), map(operator.add, map(_num_computed, requests),
                                                                          repeat(1))))
        n = len(requests)
        lengths = np.fromiter(map(len, map(_all_token_ids, requests)), np.int64, n)
        limits = np.fromiter(map(_length_limit, requests), np.int64, n)
        may_stop = (np.fromiter(map(operator.contains, map(_stop_candidates, requests), tokens), bool, n)
                    | (lengths >= np.minimum(limits, self.config.max_model_len)))
        if any(map(_structured, requests)):  # its grammar takes every token
            may_stop |= np.fromiter(map(operator.is_not, map(_structured, requests), repeat(None)), bool, n)
        if plain is not None and logprobs is None:
            requests, tokens, may_stop = self._pack_plain(requests, tokens, may_stop, plain)
        outputs = list(map(EngineCoreOutput, map(_caller_id, requests), map(_sample_index, requests),
                           [[token] for token in tokens], repeat(None), repeat(None), repeat(None),
                           map(len, map(_prompt_token_ids, requests)), map(_num_cached, requests)))
        if logprobs is not None:
            for request, output, token_logprobs in zip(requests, outputs, logprobs):
                if token_logprobs is not None:
                    request.output_logprobs.append(token_logprobs)
                    output.new_logprobs = [token_logprobs]
        for i in np.flatnonzero(may_stop).tolist():
            request = requests[i]
            status = self._check_stop(request, tokens[i])
            if status is not None:
                self._finish(request, status)
                outputs[i] = self._output(request, outputs[i].new_token_ids, outputs[i].new_logprobs, None)
        return outputs

    @staticmethod
    def _pack_plain(requests: list[Request], tokens: list[int], may_stop: np.ndarray, plain: PlainTokens
                    ) -> tuple[list[Request], list[int], np.ndarray]:
        """Move the tokens that cannot end their request, of sample 0 (an n > 1 request's other
        samples go by their index), into `plain`; returns the rest."""
        packed = ~may_stop
        if any(map(_sample_index, requests)):
            packed &= np.fromiter(map(operator.not_, map(_sample_index, requests)), bool, len(requests))
        if packed.all():
            plain.add(list(map(_caller_id, requests)), tokens, list(map(_num_cached, requests)))
            return [], [], may_stop[:0]
        rows, rest = np.flatnonzero(packed).tolist(), np.flatnonzero(~packed).tolist()
        plain.add([requests[i].caller_id for i in rows], [tokens[i] for i in rows],
                  [requests[i].num_cached_tokens for i in rows])
        return [requests[i] for i in rest], [tokens[i] for i in rest], may_stop[rest]
