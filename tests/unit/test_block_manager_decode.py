"""The block manager's decode path: random operation sequences (new, step, fork, free,
preempt) checked against a simulated KV store, the O(1) decode append against the full one,
and decode leases (spent without a call, renewed as the scheduler does). Split from
test_block_manager.py, whose helpers it uses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from unit.test_block_manager import BS, alloc, make, prompt, snapshot

def test_a_decode_lease_is_the_last_blocks_room_when_nothing_else_needs_doing():
    bm = make(10)
    tokens = prompt(0, 6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    alloc(bm, "a", tokens)
    assert bm.decode_lease("a") == 8  # positions 6 and 7 need no call
    tokens += [60, 61]  # spent without a call; the next decode crosses into a new block
    assert bm.append_slots("a", tokens + [62], 9, 8) and bm.block_table("a") == [0, 1, 2]
    assert bm.decode_lease("a") == 12
    bm.check_invariants()
    bm.free("a")


def test_no_decode_lease_in_a_shared_last_block_or_under_a_window():
    bm = make(10)
    tokens = prompt(0, 6)
    alloc(bm, "a", tokens)
    bm.fork("a", "b")  # block 1 is shared: the next write copies it first
    assert bm.decode_lease("a") == bm.decode_lease("b") == 0
    windowed = BlockManager(10, block_size=BS, enable_prefix_caching=True, sliding_window=8)
    alloc(windowed, "w", prompt(100, 6))
    assert windowed.decode_lease("w") == 0


# --- randomized: a simulated KV store checks every sequence reads back its own tokens ---

# Prompts over a two-token vocabulary make cache hits common. Steps are listed twice, and
# decode samples from four tokens, because sibling decodes after a fork exercise copy-on-write.
_step = st.tuples(st.just("step"), st.integers(0, 20), st.integers(0, 3), st.integers(1, 8))
_ops = st.one_of(
    st.tuples(st.just("new"), st.lists(st.integers(0, 1), min_size=1, max_size=12), st.integers(1, 8)),
    _step,
    _step,
    st.tuples(st.just("fork"), st.integers(0, 20)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("preempt")),
)


class _Sim:
    """Drives a BlockManager like a scheduler and keeps a fake KV store, where each slot holds
    the token prefix that produced it, so wrong sharing or a missed copy shows up as bad KV.

    A step's copies and writes stay pending until the next operation, which may instead
    preempt that step's sequence: then they never happen, as when a scheduler takes back a
    sequence it had already scheduled.
    """

    def __init__(self, bm: BlockManager, leases: bool = False) -> None:
        """`leases`: one-token decode steps hold a decode lease, as the scheduler's steady
        decodes do: no call while it lasts, then append_slots from the write position."""
        self.bm = bm
        self.leases: dict[str, int] | None = {} if leases else None
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.pending: tuple[str, list, dict] | None = None
        self.next_id = 0

    def schedule(self, seq_id: str, start: int, end: int) -> None:
        table, toks = self.bm.block_table(seq_id), self.tokens[seq_id]
        writes = {(table[pos // BS], pos % BS): tuple(toks[:pos + 1]) for pos in range(start, end)}
        self.pending = (seq_id, self.bm.take_blocks_to_copy(), writes)
        self.num_computed[seq_id] = end

    def flush(self) -> None:
        if self.pending is not None:
            _, copies, writes = self.pending
            for src, dst in copies:
                for slot in range(BS):
                    if (src, slot) in self.kv:
                        self.kv[(dst, slot)] = self.kv[(src, slot)]
            self.kv.update(writes)
            self.pending = None

    def preempt(self) -> None:
        if self.pending is not None:
            seq_id = self.pending[0]
            self.pending = None
            self.bm.free(seq_id, step_discarded=True)
            del self.tokens[seq_id], self.num_computed[seq_id]
            self._forget_lease(seq_id)

    def new(self, toks: list[int], chunk: int) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        computed, num_cached = self.bm.get_computed_blocks(toks)
        assert num_cached == len(computed) * BS < len(toks)
        for i, block_id in enumerate(computed):  # a hit must hold exactly this prefix's KV
            for slot in range(BS):
                assert self.kv.get((block_id, slot)) == tuple(toks[:i * BS + slot + 1])
        end = min(len(toks), num_cached + chunk)
        before = snapshot(self.bm, list(self.tokens))
        if not self.bm.allocate(seq_id, toks, end, computed):
            assert snapshot(self.bm, list(self.tokens)) == before
            return
        self.tokens[seq_id] = list(toks)
        self.schedule(seq_id, num_cached, end)

    def step(self, seq_id: str, sampled: int, chunk: int) -> None:
        toks, start = self.tokens[seq_id], self.num_computed[seq_id]
        decoding = start == len(toks)  # prefill done: the step decodes one sampled token
        if decoding:
            toks.append(sampled)
        end = min(len(toks), start + chunk)
        if self.leases is not None and decoding and end == start + 1:
            if start < self.leases.get(seq_id, 0):  # the lease covers this write: no call
                self.schedule(seq_id, start, end)
                return
            if self.leases.get(seq_id):  # spent: renew from the write position
                if not self.bm.append_slots(seq_id, toks, end, start):
                    toks.pop()
                    return
                self.leases[seq_id] = self.bm.decode_lease(seq_id)
                self.schedule(seq_id, start, end)
                return
        before = snapshot(self.bm, list(self.tokens))
        if not self.bm.append_slots(seq_id, toks, end):
            assert snapshot(self.bm, list(self.tokens)) == before
            if decoding:
                toks.pop()
            return
        if self.leases is not None and decoding and end == start + 1:
            self.leases[seq_id] = self.bm.decode_lease(seq_id)
        self.schedule(seq_id, start, end)

    def _forget_lease(self, seq_id: str) -> None:
        if self.leases is not None:
            self.leases.pop(seq_id, None)

    def fork(self, parent: str) -> None:
        child = f"s{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child)
        self._forget_lease(parent)  # its last block is shared now, as the scheduler knows
        self.tokens[child] = list(self.tokens[parent])
        self.num_computed[child] = self.num_computed[parent]

    def free(self, seq_id: str) -> None:
        self.bm.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]
        self._forget_lease(seq_id)

    def check(self) -> None:
        self.bm.check_invariants()
        for seq_id, toks in self.tokens.items():
            table = self.bm.block_table(seq_id)
            for pos in range(self.num_computed[seq_id]):
                assert self.kv.get((table[pos // BS], pos % BS)) == tuple(toks[:pos + 1]), seq_id


@settings(max_examples=500, deadline=None)
@given(ops=st.lists(_ops, min_size=5, max_size=50), num_blocks=st.integers(1, 16), leases=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, leases):
    run_random_operations(_Sim(BlockManager(num_blocks, block_size=BS), leases), ops, num_blocks)


def run_random_operations(sim: _Sim, ops: list[tuple], num_blocks: int) -> None:
    """Apply `ops` to `sim`, checking its KV and the invariants after each; at the end every
    sequence is freed and every block must be free again."""
    for op in ops:
        if op[0] == "preempt":
            sim.preempt()
        sim.flush()
        sim.check()
        live = sorted(sim.tokens)
        if op[0] == "new":
            sim.new(op[1], op[2])
        elif op[0] != "preempt" and live:
            getattr(sim, op[0])(live[op[1] % len(live)], *op[2:])
        sim.bm.check_invariants()
    sim.flush()
    sim.check()
    for seq_id in list(sim.tokens):
        sim.free(seq_id)
    sim.bm.check_invariants()
    assert sim.bm.num_free_blocks == num_blocks
    assert all(sim.bm.ref_count(b) == 0 for b in range(num_blocks))


class _FullAppendOnly(BlockManager):
    """append_slots without its two decode cases: the reference those must equal."""

    def _fits_last_block(self, *args) -> bool:
        return False

    def _opens_next_block(self, *args) -> bool:
        return False


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_ops, min_size=5, max_size=50), num_blocks=st.integers(1, 16), leases=st.booleans())
def test_decode_fast_path_leaves_the_same_state_as_the_full_append(ops, num_blocks, leases):
    fast = _Sim(BlockManager(num_blocks, block_size=BS), leases)
    full = _Sim(_FullAppendOnly(num_blocks, block_size=BS), leases)
    run_random_operations(fast, ops, num_blocks)
    run_random_operations(full, ops, num_blocks)
    # Every allocation, copy, hash and free since the start shows in the free queue's order
    # and the cache map.
    assert list(fast.bm._free) == list(full.bm._free)
    assert fast.bm._cached == full.bm._cached


def test_decode_inside_the_last_block_takes_the_fast_path():
    bm = make(10)
    tokens = prompt(0, BS + 2)
    alloc(bm, "a", tokens[:BS + 1])
    table = bm.live_block_table("a")
    state = bm._seqs["a"]
    assert bm._fits_last_block(state, BS + 1, BS + 2)
    assert not bm._fits_last_block(state, BS + 1, 2 * BS)  # fills the block: it must be hashed
    assert bm.append_slots("a", tokens, BS + 2)
    assert bm.live_block_table("a") is table and len(table) == 2
    bm.fork("a", "b")  # the last block is shared now: a write must copy it first
    assert not bm._fits_last_block(state, BS + 2, BS + 3)
    bm.free("a")
    bm.free("b")
