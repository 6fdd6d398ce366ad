"""The scheduler of async scheduling (engine/async_step.py): `schedule_ahead` schedules step
N+1 while step N still runs, where that changes no output; every other step is the
synchronous `Scheduler.schedule`. (vLLM keeps its own in an AsyncScheduler subclass too.)"""

from __future__ import annotations

import operator
from itertools import repeat

from engine.outputs import SchedulerOutput
from engine.scheduler import Scheduler
from engine.steady_decodes import _decode_entry, _lease_end, _num_computed, _spec_token_ids


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps_ahead_of_admission = 0  # steps gone ahead past a request waiting for a seat

    def schedule(self) -> SchedulerOutput:
        self._steps_ahead_of_admission = 0  # this step admits whoever waits
        return super().schedule()

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The next step, scheduled while the current one still runs (engine/async_step.py), or
        None where it must wait for the current step's outputs.

        It goes ahead only where every running request is a steady decode and no waiting one
        could be admitted (admission, preemption and copies are the synchronous path's). The
        requests' counters do not yet include the token in flight: each runs one position
        further (the runner adds it), so its lease must cover that slot, and a spent lease is
        renewed here through the block manager. Blocks full up to the token in flight are
        hashed then: that token is known, and the step in flight writes its KV. Finished ids
        stay for the next synchronous step (only a speculator reads them, and none runs ahead)."""
        running = self.running
        if (not running or self.waiting_for_grammar or self.failed_outputs
                or len(running) > self.config.max_num_batched_tokens or any(map(_spec_token_ids, running))
                or not self._may_defer_admission()):
            return None
        slots = list(map(operator.add, map(_num_computed, running), repeat(2)))  # through the next position
        if not all(map(operator.le, slots, map(_lease_end, running))):
            for request, end in zip(running, slots):
                if end > request.decode_lease_end and not self._renew_lease(request, end):
                    return None
        out = SchedulerOutput(list(map(_decode_entry, running)), num_steady=len(running),
                              steady_requests=running[:], num_batched_tokens=len(running),
                              num_finished=self.num_finished)
        out.kv_saves, out.kv_restores = self.block_manager.take_offload_copies()  # a renewal's saves
        return out

    def _may_defer_admission(self) -> bool:
        """Whether a step may go ahead with the waiting requests as they are. Admission is the
        synchronous path's, and under load a seat frees nearly every step (a request ends), so
        admitting at once would keep almost every step synchronous. With the batch at least
        half full, a request waiting for a seat waits up to `async_admission_steps` steps
        ahead; the synchronous step after them admits everyone who waited, in one prefill."""
        config = self.config
        if not self.waiting or len(self.running) + self.waiting[0][1].num_seats > config.max_num_seqs:
            return True  # nobody could be admitted anyway
        if self._steps_ahead_of_admission >= config.async_admission_steps or \
                2 * len(self.running) < config.max_num_seqs:
            return False
        self._steps_ahead_of_admission += 1
        return True
