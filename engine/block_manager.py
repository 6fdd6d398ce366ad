"""Paged KV-cache block manager: reference counts, prefix caching, copy-on-write fork.

Pure Python over ints: it hands out block ids and the model runner turns them into tensors.
A sequence's block table maps token positions to blocks:

    token position:  0 ........ 15 | 16 ....... 31 | 32 .. 36
    block table:     [    7        ,      3        ,    12    ]   block_size = 16
                      full, cached   full, cached   partial (written next)

Prefix caching keys each full block by a chained hash of (parent_hash, tokens, extra_keys),
so a key covers the whole prefix before it. The hash is a real digest (BLAKE2b, 64 bits), not
Python's `hash()`, which salts strings per process: every process computes the same key for
the same blocks (common.prefix_hash), so a frontend can tell which engine holds a prompt's
prefix. A prompt's images enter the key of the block where each one's placeholder tokens
start (common.multimodal.image_block_keys): the same tokens with another image never hit.
Blocks dropping to ref 0 join an LRU free queue but keep their hash, and can be hit
until popped for reuse. Free queue, front popped first:

    [never used ...] [seq A's last block, ..., seq A's first block] [seq B's ...]

Sliding windows (`sliding_window=W`, only when every layer of the model is windowed): a
step that writes positions from p on reads no key before p - W + 1, and later steps read
even less, so blocks wholly before it are released as the sequence moves on. The table keeps
its length (positions still map to entries), with FREED_BLOCK in the released entries:

    W = 20, block_size = 8, this step writes position 40 (keys 21..40 visible):
    token position:  0 ... 7 | 8 ... 15 | 16 ... 23 | 24 ... 31 | 32 ... 39 | 40
    block table:     [  -1   ,    -1    ,    12     ,     3     ,     9     ,  4 ]
                      released (ref dropped)  ^ holds key 21: kept

A released block is an ordinary ref drop: at ref 0 it joins the free queue and, if it is
cached, stays hittable until reused, so a later prompt with the same prefix can still hit it.
Backends never read entries before a row's first visible block (engine/attention), so the
placeholder is never dereferenced. A sequence thus holds at most
`window_peak_blocks(step tokens)` blocks however long it grows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from common.multimodal import image_block_keys
from common.prefix_hash import ROOT_HASH, hash_block
from engine.kv_offload.index import OffloadIndex

FREED_BLOCK = -1  # a released table entry, before every window (see the module docstring)


@dataclass(slots=True)
class Block:
    """One KV-cache block. `block_hash` is set only while the block is in the prefix cache;
    the key parts are kept so a hit can be verified rather than trusted to the hash."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple = ()

    def matches(self, parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple) -> bool:
        return (self.token_ids == token_ids and self.parent_hash == parent_hash
                and self.extra_keys == extra_keys)


@dataclass(slots=True)
class _SeqBlocks:
    """Per-sequence state: its block table and the hashes of its full blocks so far."""

    block_ids: list[int]
    extra_keys: tuple
    num_tokens: int = 0  # tokens the table covers; the latest call's step writes KV up to here
    block_hashes: list[int] = field(default_factory=list)
    num_written_hashes: int = 0  # hashes whose KV existed before the latest call (see free)
    # False after a hash collision: later blocks' chain would be ambiguous, so stop caching them.
    hashable: bool = True
    num_released: int = 0  # leading entries released behind the sliding window (FREED_BLOCK)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences keyed by id. Not thread-safe: the scheduler is its
    only caller."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, offload: OffloadIndex | None = None) -> None:
        """`sliding_window`: every layer of the model attends to at most this many tokens, so
        blocks behind it are released (None: full attention somewhere, keep every block).
        `offload`: a second tier under the prefix cache (engine/kv_offload), for full attention."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hits = 0  # of those, tokens served from cache
        # Cached blocks popped for reuse go to the second tier first; a prefix missing here but
        # held there is restored into fresh blocks (allocate).
        self.offload = offload if enable_prefix_caching and sliding_window is None else None
        self.num_offload_hits = 0  # prompt tokens restored from the second tier
        # (src, dst) block copies the model runner must do before the next forward.
        self.blocks_to_copy: list[tuple[int, int]] = []
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Ref-0 blocks; O(1) pop-front, append and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self._seqs: dict[str, _SeqBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, including evictable cached blocks with ref 0."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window_peak_blocks(self, max_step_tokens: int) -> int | None:
        """The most blocks one sequence ever holds when a step writes at most
        `max_step_tokens` of it: the window before its first new token plus those, over
        block boundaries. None without a sliding window (a sequence holds its whole context)."""
        if self.sliding_window is None:
            return None
        return self.num_blocks_needed(self.sliding_window - 1 + max_step_tokens) + 1

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def live_block_table(self, seq_id: str) -> list[int]:
        """The sequence's table itself, not a copy (a step's inputs read it; copying every
        table every step is O(context) per sequence). Read-only for the caller: it changes
        in place as the sequence grows, and is replaced if the sequence is freed."""
        return self._seq(seq_id).block_ids

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """Return and clear the pending copy-on-write copies."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def get_computed_blocks(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks: (block_ids, num_cached_tokens).

        Never covers the last token, so the model computes >= 1 token and yields logits.
        Takes no references. Returns ([], 0) and counts nothing when caching is off. With a
        second tier, num_cached_tokens also covers the blocks after those that it holds: pass it
        on to `allocate`, which restores them into fresh blocks.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        block_ids = self._cached_prefix(token_ids, extra_keys, max_blocks)
        self.num_cache_queries += len(token_ids)
        self.num_cache_hits += len(block_ids) * self.block_size
        num_offloaded = len(self._offloaded(token_ids, extra_keys, block_ids, max_blocks))
        return block_ids, (len(block_ids) + num_offloaded) * self.block_size

    def can_allocate(self, num_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Whether `allocate` with these arguments would find enough free blocks."""
        num_new = self.num_blocks_needed(num_tokens) - len(computed_block_ids)
        live = computed_block_ids[self._num_behind_window(len(computed_block_ids) * self.block_size):]
        num_revived = sum(1 for b in live if self._blocks[b].ref_count == 0)
        return max(0, num_new) + num_revived <= self.num_free_blocks

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                 computed_block_ids: Sequence[int] = (), extra_keys: tuple = (),
                 num_cached_tokens: int | None = None) -> bool:
        """First allocation for a sequence (new, or resumed after preemption).

        Takes references on `computed_block_ids` (from get_computed_blocks; with a sliding
        window, only on those the first new token can see: the others start out released)
        and adds fresh blocks so the table covers `num_tokens` (cached + scheduled) tokens.
        Returns False and changes nothing if blocks run short. Registers blocks that become full.
        `num_cached_tokens` (get_computed_blocks'): the second tier's blocks past the computed
        ones go into the first fresh blocks, restored before the step's forward.
        """
        if seq_id in self._seqs and self._seqs[seq_id].block_ids:
            raise ValueError(f"sequence {seq_id!r} already has blocks; use append_slots")
        computed = list(computed_block_ids)
        if num_tokens < len(computed) * self.block_size:
            raise ValueError(f"num_tokens={num_tokens} < the {len(computed)} computed blocks' tokens")
        if computed and self._cached_prefix(token_ids, extra_keys, len(computed)) != computed:
            # Another allocation evicted them since get_computed_blocks: they hold other KV now.
            raise ValueError(f"computed blocks {computed} are no longer cached for these tokens")
        offloaded = self._offloaded_to_restore(token_ids, extra_keys, computed, num_cached_tokens)
        if not self.can_allocate(num_tokens, computed):
            return False
        for block_hash in offloaded:  # before popping blocks, whose saves could evict these slots
            self.offload.hold(block_hash)
        released = self._num_behind_window(len(computed) * self.block_size)
        for block_id in computed[released:]:
            self._take_ref(block_id)
        num_new = self.num_blocks_needed(num_tokens) - len(computed)
        state = _SeqBlocks(block_ids=[FREED_BLOCK] * released + computed[released:]
                           + [self._pop_free_block() for _ in range(num_new)],
                           extra_keys=extra_keys, num_tokens=num_tokens,
                           block_hashes=[self._blocks[b].block_hash for b in computed],
                           num_written_hashes=len(computed) + len(offloaded), num_released=released)
        for block_hash, block_id in zip(offloaded, state.block_ids[len(computed):]):
            self.offload.restore(block_hash, block_id)  # their KV is there before any step reads it
        self.num_offload_hits += len(offloaded) * self.block_size
        self._seqs[seq_id] = state
        self._register_full_blocks(state, token_ids)
        return True

    def append_slots(self, seq_id: str, token_ids: Sequence[int], num_tokens: int,
                     num_computed_tokens: int | None = None) -> bool:
        """Grow a sequence's table to cover `num_tokens` tokens (token_ids: all its tokens,
        never draft tokens: so no block hash covers an unverified token).

        This step writes KV from `num_computed_tokens` (default: the end of what the table
        covered) on; a shared block in that range is copied first (recorded in
        `blocks_to_copy`). With a sliding window, blocks no position from there on can see
        are released first (their room counts toward this step's). A table never shrinks:
        slots that speculative decoding's rejected drafts took stay allocated and are simply
        written again later. Returns False and changes nothing if blocks run short.
        """
        state = self._seq(seq_id)
        first_write = state.num_tokens if num_computed_tokens is None else num_computed_tokens
        if self._fits_last_block(state, first_write, num_tokens):
            state.num_tokens = num_tokens
            state.num_written_hashes = len(state.block_hashes)
            return True
        if self._opens_next_block(state, first_write, num_tokens):
            state.block_ids.append(self._pop_free_block())
            state.num_tokens = num_tokens
            state.num_written_hashes = len(state.block_hashes)
            self._register_full_blocks(state, token_ids)
            return True
        num_tokens = max(num_tokens, state.num_tokens)
        num_new = self.num_blocks_needed(num_tokens) - len(state.block_ids)
        shared = [i for i in range(first_write // self.block_size, len(state.block_ids))
                  if self._blocks[state.block_ids[i]].ref_count > 1] if num_tokens > first_write else []
        release = max(state.num_released, self._num_behind_window(first_write))
        room = sum(1 for i in range(state.num_released, release) if self._blocks[state.block_ids[i]].ref_count == 1)
        if num_new + len(shared) > self.num_free_blocks + room:
            return False
        self._release(state, release)
        for i in shared:
            src = state.block_ids[i]
            dst = self._pop_free_block()
            self._blocks[src].ref_count -= 1  # was > 1, so src stays owned by another sequence
            self.blocks_to_copy.append((src, dst))
            state.block_ids[i] = dst
        state.block_ids.extend(self._pop_free_block() for _ in range(num_new))
        state.num_tokens = num_tokens
        state.num_written_hashes = len(state.block_hashes)  # the previous step has run
        self._register_full_blocks(state, token_ids)
        return True

    def decode_lease(self, seq_id: str) -> int:
        """A decode lease: the sequence may write KV at positions below the returned one, one
        per step, with no call here (0: no lease). That is its last block's room, where nothing
        else needs doing (see `_fits_last_block`): the sequence alone holds the block and there
        is no window to release behind. The scheduler spends the lease on its own and calls
        `append_slots` again once it is spent; `fork` and `free` end it (the scheduler forgets
        the lease when it forks or preempts). Meanwhile the table covers fewer tokens here than
        the sequence has, which only `append_slots` reads, and corrects. A step that spends the
        lease makes no call, so its discarding (`free(step_discarded=...)`) concerns none."""
        state = self._seq(seq_id)
        block_ids = state.block_ids
        if self.sliding_window is not None or self._blocks[block_ids[-1]].ref_count != 1:
            return 0
        return len(block_ids) * self.block_size

    def _fits_last_block(self, state: _SeqBlocks, first_write: int, num_tokens: int) -> bool:
        """The decode step's O(1) case, which needs none of append_slots' work: the step writes
        only into the table's last block, which this sequence alone holds and which stays
        short of full (so there is no block to add, copy, release or hash)."""
        bs, block_ids = self.block_size, state.block_ids
        return (first_write == state.num_tokens < num_tokens < len(block_ids) * bs
                and first_write // bs == len(block_ids) - 1 and self.sliding_window is None
                and self._blocks[block_ids[-1]].ref_count == 1)

    def _opens_next_block(self, state: _SeqBlocks, first_write: int, num_tokens: int) -> bool:
        """The other decode case, 1 step in block_size: the step writes the first position past
        a full table, so it needs one new block, and nothing is shared or behind a window (the
        general case, in short). The count of tokens here may lag behind first_write where a
        decode lease was spent: those positions were the last block's, which the lease held."""
        return (num_tokens == first_write + 1 == len(state.block_ids) * self.block_size + 1
                and state.num_tokens <= first_write and self.sliding_window is None and bool(self._free))

    def free(self, seq_id: str, step_discarded: bool = False) -> None:
        """Drop a sequence's references; unknown ids are a no-op.

        Blocks reaching ref 0 join the free queue's tail in reverse table order, so a
        sequence's last blocks are evicted before its (more shareable) prefix blocks.
        Pass `step_discarded=True` when the step that ran the latest allocate/append_slots
        for this sequence will not execute (preempted in the same step): blocks that call
        cached would never get their KV written, so they leave the cache.
        """
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        if step_discarded:
            for i in range(max(state.num_written_hashes, state.num_released), len(state.block_hashes)):
                block = self._blocks[state.block_ids[i]]
                if block.block_hash == state.block_hashes[i]:  # not a duplicate of another block
                    del self._cached[block.block_hash]
                    self._uncache(block)
        blocks, free = self._blocks, self._free  # _drop_ref, inlined: every finished request runs this
        for block_id in reversed(state.block_ids[state.num_released:]):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                free[block_id] = None

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's block table, sharing every block (copy-on-write)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into existing sequence {child_id!r}")
        for block_id in parent.block_ids[parent.num_released:]:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_id] = _SeqBlocks(
            block_ids=list(parent.block_ids), extra_keys=parent.extra_keys, num_tokens=parent.num_tokens,
            block_hashes=list(parent.block_hashes), hashable=parent.hashable,
            num_written_hashes=parent.num_written_hashes, num_released=parent.num_released)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since a
        running sequence's chain would then point at blocks no longer in the cache."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self._cached.values():
            self._uncache(self._blocks[block_id])
        self._cached.clear()
        self.drop_offload()
        return True

    def check_invariants(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent (for tests)."""
        table_refs = [0] * self.num_blocks
        for seq_id, state in self._seqs.items():
            _expect(len(state.block_ids) == self.num_blocks_needed(state.num_tokens), f"{seq_id}: table size")
            released = state.num_released
            _expect(released == 0 or self.sliding_window is not None, f"{seq_id}: released without a window")
            _expect(all(b == FREED_BLOCK for b in state.block_ids[:released]), f"{seq_id}: released entries")
            for block_id in state.block_ids[released:]:
                _expect(block_id != FREED_BLOCK, f"{seq_id}: a released entry after live ones")
                table_refs[block_id] += 1
        for block in self._blocks:
            name = f"block {block.block_id}"
            _expect(block.ref_count == table_refs[block.block_id] >= 0, f"{name}: ref_count != table refs")
            _expect((block.ref_count == 0) == (block.block_id in self._free), f"{name}: free iff ref 0")
            _expect(block.block_hash is None or self._cached.get(block.block_hash) == block.block_id,
                    f"{name}: has a hash but is not in the cache map")
        for block_hash, block_id in self._cached.items():
            _expect(self._blocks[block_id].block_hash == block_hash, f"stale map entry for {block_id}")
        if self.offload is not None:
            self.offload.check_invariants()

    def _seq(self, seq_id: str) -> _SeqBlocks:
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return state

    def _cached_prefix(self, token_ids: Sequence[int], extra_keys: tuple, max_blocks: int) -> list[int]:
        """Cached blocks for up to `max_blocks` leading full blocks, each hit verified."""
        block_ids: list[int] = []
        for block_hash, parent, tokens, keys in self._prompt_blocks(token_ids, extra_keys, 0, max_blocks, ROOT_HASH):
            block_id = self._cached.get(block_hash)
            if block_id is None or not self._blocks[block_id].matches(parent, tokens, keys):
                break
            block_ids.append(block_id)
        return block_ids

    def _prompt_blocks(self, token_ids: Sequence[int], extra_keys: tuple, first: int, end: int,
                       parent: int | None) -> Iterator[tuple[int, int | None, tuple[int, ...], tuple]]:
        """(hash, parent hash, tokens, extra keys) of the prompt's full blocks first..end-1, the
        chain going on from `parent`: what a lookup in either tier checks."""
        bs = self.block_size
        for i in range(first, end):
            tokens, keys = tuple(token_ids[i * bs:(i + 1) * bs]), image_block_keys(extra_keys, i, bs)
            block_hash = hash_block(parent, tokens, keys)
            yield block_hash, parent, tokens, keys
            parent = block_hash

    def _offloaded(self, token_ids: Sequence[int], extra_keys: tuple, cached: Sequence[int],
                   max_blocks: int) -> list[int]:
        """Hashes of the blocks after the `cached` ones that the second tier holds, each hit
        verified, up to `max_blocks` blocks in all."""
        if self.offload is None or len(cached) >= max_blocks:
            return []
        parent = self._blocks[cached[-1]].block_hash if cached else ROOT_HASH
        hashes = []
        for block_hash, parent, tokens, keys in self._prompt_blocks(token_ids, extra_keys, len(cached), max_blocks,
                                                                   parent):
            if self.offload.lookup(block_hash, parent, tokens, keys) is None:
                break
            hashes.append(block_hash)
        return hashes

    def _offloaded_to_restore(self, token_ids: Sequence[int], extra_keys: tuple, computed: list[int],
                              num_cached_tokens: int | None) -> list[int]:
        """allocate's second-tier blocks: all that `num_cached_tokens` counts past `computed`."""
        if num_cached_tokens is None or num_cached_tokens <= len(computed) * self.block_size:
            return []
        offloaded = self._offloaded(token_ids, extra_keys, computed, num_cached_tokens // self.block_size)
        if (len(computed) + len(offloaded)) * self.block_size != num_cached_tokens:
            raise ValueError(f"num_cached_tokens={num_cached_tokens}: the second tier holds "
                             f"{len(offloaded)} blocks past the {len(computed)} computed ones")
        return offloaded

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's second-tier (block_id, slot) saves and (slot, block_id) restores; clears them."""
        return self.offload.take_copies() if self.offload is not None else ([], [])

    def drop_offload(self, turn_off: bool = False) -> None:
        """Forget what the second tier holds (its KV is stale: new weights, a dropped cache);
        `turn_off`: and save nothing more (its store failed)."""
        if self.offload is not None:
            self.offload.reset()
        if turn_off:
            self.offload = None

    def _num_behind_window(self, first_write: int) -> int:
        """Leading blocks that no query at `first_write` or later can see: those wholly before
        position first_write - W + 1 (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, first_write - self.sliding_window + 1) // self.block_size

    def _release(self, state: _SeqBlocks, end: int) -> None:
        """Drop the references of table entries [num_released, end), oldest first."""
        for i in range(state.num_released, end):
            self._drop_ref(state.block_ids[i])
            state.block_ids[i] = FREED_BLOCK
        state.num_released = max(state.num_released, end)

    def _drop_ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _take_ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free_block(self) -> int:
        """Take the least recently freed block, evicting its cached hash if it has one."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            if self.offload is not None:  # its KV is overwritten after this step's saves
                self.offload.save(block.block_hash, block.parent_hash, block.token_ids, block.extra_keys, block_id)
            del self._cached[block.block_hash]
            self._uncache(block)
        block.ref_count = 1
        return block_id

    @staticmethod
    def _uncache(block: Block) -> None:
        block.block_hash = block.parent_hash = None
        block.token_ids = block.extra_keys = ()

    def _register_full_blocks(self, state: _SeqBlocks, token_ids: Sequence[int]) -> None:
        """Cache each block that is now full. Safe before its KV exists: this step's forward
        writes it before any later step can read it."""
        if not self.enable_prefix_caching or not state.hashable:
            return
        bs = self.block_size
        for i in range(len(state.block_hashes), min(state.num_tokens, len(token_ids)) // bs):
            parent = state.block_hashes[-1] if state.block_hashes else ROOT_HASH
            tokens, keys = tuple(token_ids[i * bs:(i + 1) * bs]), image_block_keys(state.extra_keys, i, bs)
            block_hash = hash_block(parent, tokens, keys)
            cached_id = self._cached.get(block_hash)
            if cached_id is None and i < state.num_released:  # never: released blocks were full already
                state.hashable = False
                return
            if cached_id is None:
                block = self._blocks[state.block_ids[i]]
                block.block_hash, block.parent_hash = block_hash, parent
                block.token_ids, block.extra_keys = tokens, keys
                self._cached[block_hash] = block.block_id
            elif not self._blocks[cached_id].matches(parent, tokens, keys):
                state.hashable = False  # collision: keep the first block, cache nothing after
                return
            state.block_hashes.append(block_hash)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
