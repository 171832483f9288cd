"""KV-cache groups, the single-type managers and the coordinator (lesson 13): the grouping rule, the
sliding window's freed blocks and null block, the hybrid prefix-cache hit, all-or-none allocation,
and a state machine against a plain model of what each group must hold."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_pool import NULL_BLOCK, BlockPool
from paged_kv.core.kv_cache_coordinator import (
    ComputedBlocks,
    HybridKVCacheCoordinator,
)
from paged_kv.core.kv_cache_groups import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    kv_cache_groups,
    layer_tensors,
    num_tensors,
)
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.core.prefix_cache import chain_hashes, full_blocks
from paged_kv.core.single_type_kv_cache_manager import SlidingWindowManager, get_manager_for_kv_cache_spec

pytestmark = pytest.mark.lesson13


def req(request_id):
    """A request as the manager reads it: its id."""
    return SimpleNamespace(request_id=request_id)


# ------------------------------------------------------------------------------ the grouping rule


def layers_of(groups):
    return [(type(g.spec).__name__[0], g.layers) for g in groups]


def test_layers_are_grouped_by_spec_into_groups_of_one_size():
    # Gemma 3 27B: 62 layers, every 6th full. 10 full layers set the group size; the 52 sliding
    # ones split into 6 groups of 9, 9, 9, 9, 8 and 8 layers (padded to 10), layers[i::6].
    gemma3 = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]
    groups = kv_cache_groups(gemma3, 16)
    assert [len(g.layers) for g in groups] == [9, 9, 9, 9, 8, 8, 10] and num_tensors(groups) == 10
    assert groups[0].layers[:3] == (0, 7, 14) and groups[-1].layers == tuple(range(5, 62, 6))
    # 12 sliding and 13 full layers (gpt-oss-20b with a drafter's layer): 13 < 1.5 * 12, so one
    # group of each, the smaller padded.
    gpt_oss = [128, None] * 12 + [None]
    assert [len(g.layers) for g in kv_cache_groups(gpt_oss, 16)] == [12, 13]
    # One kind of layer: one group (Mistral slides everywhere, Llama never).
    assert layers_of(kv_cache_groups([4096] * 3, 16)) == [("S", (0, 1, 2))]
    assert layers_of(kv_cache_groups([None] * 3, 16)) == [("F", (0, 1, 2))]
    # Windows of two sizes are two specs.
    assert layers_of(kv_cache_groups([8, 16, 8, 16], 4)) == [("S", (0, 2)), ("S", (1, 3))]


def test_a_layer_reads_the_tensor_of_its_index_within_its_group():
    groups = kv_cache_groups([8, None, 8, None], 4)  # Gemma 2's alternation: (0, 2) and (1, 3)
    assert layer_tensors(groups) == {0: 0, 2: 1, 1: 0, 3: 1}


@pytest.mark.parametrize(
    ("windows", "match"),
    [([], "at least one layer"), ([8, 0], "layer 1"), ([True], "layer 0"), ([8.5], "layer 0")],
)
def test_bad_windows_are_refused_naming_the_layer(windows, match):
    with pytest.raises(ValueError, match=match):
        kv_cache_groups(windows, 4)


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(4, 0)
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionSpec(0)


def test_the_skipped_tokens_rule_and_the_blocks_a_hit_needs():
    spec = SlidingWindowSpec(block_size=4, sliding_window=4)
    # Tokens 0..7 computed, the next is 8: its window is 5..8, so 0..4 are skipped.
    assert [spec.num_skipped_tokens(n) for n in (0, 3, 4, 7, 8)] == [0, 0, 1, 4, 5]
    assert FullAttentionSpec(4).num_skipped_tokens(100) == 0
    assert [SlidingWindowSpec(4, w).blocks_for_hit for w in (1, 2, 5, 8, 9)] == [0, 1, 1, 2, 2]


# ------------------------------------------------------------------------ the sliding manager


def sliding_manager(block_size=2, window=4, num_blocks=64, caching=False):
    pool = BlockPool(num_blocks, enable_caching=caching)
    assert pool.null_block == NULL_BLOCK and pool.ref_count(NULL_BLOCK) == 1
    return get_manager_for_kv_cache_spec(SlidingWindowSpec(block_size, window), pool, 0)


def test_blocks_wholly_before_the_window_are_freed_and_nulled():
    # vLLM's test_sliding_window_remove_skipped_blocks: block size 2, window 4, 11 blocks.
    manager = sliding_manager()
    manager.allocate_new_blocks("r", 22)
    original = list(manager.req_to_blocks["r"])
    free = manager.block_pool.num_free_blocks

    def nulls_then_original(n):
        return [NULL_BLOCK] * n + original[n:]

    for computed, nulls in [(0, 0), (4, 0), (5, 1), (6, 1), (7, 2), (11, 4)]:
        manager.remove_skipped_blocks("r", computed)
        assert manager.req_to_blocks["r"] == nulls_then_original(nulls), computed
        assert manager.block_pool.num_free_blocks == free + nulls
    assert manager.remove_skipped_blocks("r", 11) == []  # once only


def test_a_new_request_counts_its_fresh_blocks_and_its_hits_on_the_free_list():
    # vLLM's test_get_num_blocks_to_allocate: hits sitting on the free list cost a free block each.
    manager = sliding_manager()
    free_hits = list(range(1, 11))
    assert manager.get_num_blocks_to_allocate("a", 40, free_hits) == 20
    assert manager.get_num_blocks_to_allocate("b", 40, [NULL_BLOCK] * 5 + free_hits[:5]) == 15
    held = manager.block_pool.get_new_blocks(2)  # a hit another request holds costs nothing
    assert manager.get_num_blocks_to_allocate("c", 8, held) == 2


# Block i is cached when flags[i]; the hit each case expects, in blocks (vLLM's
# test_sliding_window_possible_cached_prefix: block size 2, window 4, so 2 blocks needed).
CACHED_PREFIX_CASES = [
    ([False] * 10, 0),
    ([True], 1),
    ([True, False], 1),
    ([True, True], 2),
    ([True, True, False], 2),
    ([True, True, True], 3),
    ([True, True, True, False], 3),
    ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
    ([True, True, False, True, False, False, True, True, False, False, False], 8),
    ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
]


@pytest.mark.parametrize(("flags", "expected"), CACHED_PREFIX_CASES)
def test_a_window_hit_needs_only_the_blocks_its_first_uncomputed_token_reads(flags, expected):
    manager = sliding_manager(caching=True)
    tokens = list(range(2 * len(flags)))
    manager.allocate_new_blocks("r", len(tokens))
    manager.start_chain("r", None, 0)
    manager.cache_blocks("r", tokens)
    blocks = manager.req_to_blocks["r"]
    for block_id, cached in zip(blocks, flags, strict=True):
        if not cached:
            manager.block_pool.evict(block_id)
    pieces = full_blocks(tokens, 2)
    found, length = manager.find_longest_cache_hit(pieces, chain_hashes(pieces), len(flags))
    assert length == expected
    assert [e.block_id if e else None for e in found[-2:]] == blocks[max(0, expected - 2) : expected]
    assert all(e is None for e in found[: expected - 2])


def test_a_window_hit_never_shares_a_block_whose_prefix_differs():
    # Two prompts with the same last blocks but different first blocks: the windows' blocks
    # hash differently (their chained hashes differ), and even a forged entry of the right hash
    # would fail the walk back through its parents.
    manager = sliding_manager(caching=True)
    first = [9, 9, 1, 2, 3, 4]
    manager.allocate_new_blocks("a", 6)
    manager.start_chain("a", None, 0)
    manager.cache_blocks("a", first)
    other = [7, 7, 1, 2, 3, 4]
    pieces = full_blocks(other, 2)
    assert manager.find_longest_cache_hit(pieces, chain_hashes(pieces), 3)[1] == 0


# ------------------------------------------------- the coordinator, through the KV-cache manager


def gemma2(block_size=4, window=8):
    return kv_cache_groups([window, None, window, None], block_size)


def test_the_null_block_is_block_zero_never_handed_out_nor_freed():
    memory = KVCacheManager(9, kv_cache_groups=gemma2())
    assert isinstance(memory.coordinator, HybridKVCacheCoordinator)
    assert memory.num_free_blocks == 8 and memory.block_pool.get_usage() == 0.0
    taken = memory.allocate_slots(req("a"), 16)  # 4 blocks per group
    assert taken is not None and NULL_BLOCK not in taken[0] + taken[1]
    assert memory.block_pool.get_usage() == 1.0 and memory.allocate_slots(req("b"), 1) is None
    memory.free("a")
    assert memory.num_free_blocks == 8 and NULL_BLOCK not in memory.block_pool.free_block_ids


def test_a_sliding_group_holds_the_window_however_long_the_request():
    memory = KVCacheManager(64, kv_cache_groups=gemma2(block_size=4, window=8))
    memory.allocate_slots(req("a"), 5)
    for _ in range(200):  # decode 200 tokens
        assert memory.allocate_slots(req("a"), 1) is not None
        sliding, full = memory.get_block_ids("a")
        held = sum(b != NULL_BLOCK for b in sliding)
        assert held <= blocks_for_tokens(8 - 1 + 1, 4) + 1  # ceil((W - 1 + scheduled) / bs) + 1
        assert len(sliding) == len(full) == blocks_for_tokens(memory.num_tokens("a"), 4)
    assert sliding[: len(sliding) - 3] == (NULL_BLOCK,) * (len(sliding) - 3)
    assert NULL_BLOCK not in full


def test_allocation_is_all_or_none_over_every_group():
    memory = KVCacheManager(8, kv_cache_groups=gemma2(window=16))  # 7 blocks to give
    assert memory.allocate_slots(req("a"), 12) is not None  # 3 + 3, nothing out of the window
    before = (memory.num_free_blocks, memory.get_block_ids("a"))
    assert memory.allocate_slots(req("b"), 4) is None  # needs 1 + 1, 1 free
    assert memory.allocate_slots(req("a"), 4) is None  # a 4th block in each group
    assert (memory.num_free_blocks, memory.get_block_ids("a")) == before
    assert "b" not in memory


def test_a_refused_allocation_may_still_free_the_windows_old_blocks():
    # vLLM frees the blocks out of the window before it counts: a freeing that is never undone.
    memory = KVCacheManager(4, kv_cache_groups=kv_cache_groups([4], 4))  # one sliding group, 3 blocks
    memory.allocate_slots(req("a"), 12)
    assert memory.allocate_slots(req("b"), 1) is None
    # a's next token (position 12) reads 9..12: block 0 goes, the null block in its place.
    assert memory.allocate_slots(req("a"), 1) is not None
    assert memory.get_block_ids("a")[0][0] == NULL_BLOCK


def test_the_hybrid_hit_is_the_longest_prefix_every_group_hits():
    memory = KVCacheManager(64, kv_cache_groups=gemma2(block_size=4, window=8), enable_caching=True)
    prompt = list(range(40))
    memory.allocate_slots(req("a"), 40, prompt)
    memory.free("a")
    computed = memory.get_computed_blocks(None, prompt)
    assert computed.num_tokens == 36  # at most len - 1 tokens: 9 whole blocks
    sliding, full = computed.block_ids
    assert sliding[:7] == (NULL_BLOCK,) * 7 and NULL_BLOCK not in sliding[7:] + full
    # Evict the full group's block 4: the full hit ends at 4 blocks, and the sliding group must hit
    # again at 4 blocks, with the window of token 16 (blocks 2 and 3).
    memory.block_pool.evict(full[4])
    computed = memory.get_computed_blocks(None, prompt)
    assert computed.num_tokens == 16
    assert computed.block_ids[0][:2] == (NULL_BLOCK,) * 2 and NULL_BLOCK not in computed.block_ids[0][2:]
    # Evict the sliding group's block 3 as well: its hit at 4 blocks fails, and at 3... down to a
    # run that starts at block 0: blocks 0, 1 and 2 are still cached.
    memory.block_pool.evict(computed.block_ids[0][3])
    assert memory.get_computed_blocks(None, prompt).num_tokens == 12


def test_a_new_request_starts_with_its_hits_and_freed_window_blocks_stay_cached():
    memory = KVCacheManager(64, kv_cache_groups=gemma2(block_size=4, window=8), enable_caching=True)
    prompt = list(range(33))
    memory.allocate_slots(req("a"), 33, prompt)
    for token in range(33, 45):  # decode: the window slides and frees sliding blocks
        assert memory.allocate_slots(req("a"), 1, [*prompt, *range(33, token + 1)]) is not None
    assert memory.get_block_ids("a")[0][:8] == (NULL_BLOCK,) * 8
    free_before = memory.num_free_blocks
    computed = memory.get_computed_blocks(None, prompt)
    assert computed.num_tokens == 32  # the freed window blocks are still cached
    gained = memory.allocate_slots(req("b"), 1, prompt, new_computed_blocks=computed)
    assert gained is not None and [len(ids) for ids in gained] == [9, 9]
    assert list(gained[0][:8]) == list(computed.block_ids[0]) and list(gained[1][:8]) == list(
        computed.block_ids[1]
    )
    # b revived the sliding group's two window blocks from the free list, shared a's full blocks,
    # and took one fresh block per group.
    assert memory.num_free_blocks == free_before - 2 - 2
    assert memory.prefix_cache_stats.hits == 32


def test_a_new_requests_fresh_blocks_never_evict_another_groups_hit():
    # Every group's hits are taken before any group's fresh blocks: a fresh block comes off the head
    # of the free list, where another group's hit may still sit, cached. Here the full group's fresh
    # block would be the sliding group's hit, which it would evict and then share with it.
    memory = KVCacheManager(5, kv_cache_groups=kv_cache_groups([None, 2], 2), enable_caching=True)
    tokens = [1, 1, 1, 1]
    memory.allocate_slots(req("a"), 2, tokens)
    memory.allocate_slots(req("a"), 1, tokens)
    memory.allocate_slots(req("a"), 1, tokens)
    memory.free("a")
    computed = memory.get_computed_blocks(None, tokens)
    assert computed.num_tokens == 2
    gained = memory.allocate_slots(req("b"), 2, tokens, new_computed_blocks=computed)
    real = [b for ids in gained for b in ids if b != NULL_BLOCK]
    assert len(real) == len(set(real))  # no block in two groups
    assert [tuple(ids[:1]) for ids in gained] == list(computed.block_ids)


def test_bad_input_is_refused_naming_the_argument_and_changes_nothing():
    memory = KVCacheManager(16, kv_cache_groups=gemma2(), enable_caching=True)
    memory.allocate_slots(req("a"), 8, list(range(8)))
    before = (memory.num_free_blocks, memory.get_block_ids("a"))
    cases = [
        (lambda: memory.allocate_slots(req("a"), -1), "num_new_tokens"),
        (lambda: memory.allocate_slots(req(["x"]), 1), "request_id"),
        (lambda: memory.allocate_slots(req("a"), 4, [1, 2]), "token_ids"),
        (lambda: memory.allocate_slots(req("a"), 1, new_computed_blocks=ComputedBlocks()), "computed"),
        (lambda: memory.allocate_slots(req("b"), 1, num_tokens_to_fit=-3), "num_tokens_to_fit"),
        (lambda: memory.get_computed_blocks(None, [1, -2]), "token_ids"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
        assert (memory.num_free_blocks, memory.get_block_ids("a")) == before
    for groups, num_blocks, match in [
        ((), 8, "kv_cache_groups"),
        (
            (KVCacheGroupSpec((0,), FullAttentionSpec(4)), KVCacheGroupSpec((1,), FullAttentionSpec(8))),
            8,
            "block_size",
        ),
        (
            (KVCacheGroupSpec((0,), FullAttentionSpec(4)), KVCacheGroupSpec((0,), SlidingWindowSpec(4, 2))),
            8,
            "one group",
        ),
        (gemma2(), 1, "num_blocks"),
    ]:
        with pytest.raises(ValueError, match=match):
            HybridKVCacheCoordinator(groups, num_blocks)


def test_a_stale_hit_is_refused():
    memory = KVCacheManager(16, kv_cache_groups=gemma2(), enable_caching=True)
    prompt = list(range(12))
    memory.allocate_slots(req("a"), 12, prompt)
    memory.free("a")
    computed = memory.get_computed_blocks(None, prompt)
    assert memory.allocate_slots(req("filler"), 28) is not None  # 14 of 15 free blocks: evicts hits
    memory.free("filler")
    with pytest.raises(ValueError, match="no longer cached"):
        memory.allocate_slots(req("b"), 4, prompt, new_computed_blocks=computed)


def test_the_admission_check_caps_a_sliding_groups_share_of_a_long_prompt():
    # One sliding group of window 8, blocks of 4, 8 tokens in flight a step: a 200-token prompt
    # admitted for its first chunk needs at most ceil((8 - 1 + 8) / 4) + 1 = 5 blocks at once.
    memory = KVCacheManager(7, kv_cache_groups=kv_cache_groups([8], 4), max_in_flight_tokens=8)
    assert memory.allocate_slots(req("a"), 8, num_tokens_to_fit=200) is not None
    uncapped = KVCacheManager(7, kv_cache_groups=kv_cache_groups([8], 4))
    assert uncapped.allocate_slots(req("a"), 8, num_tokens_to_fit=200) is None


# ------------------------------------------------------------------- the state machine


class CoordinatorMachine(RuleBasedStateMachine):
    """Random requests growing, sliding and leaving over random groups, against a plain model: each
    request's token count; each group's list must hold ceil(tokens / block_size) entries, the null
    block exactly where the window of its last-but-one allocation skipped; the pool's counts add up."""

    @initialize(
        windows=st.lists(st.one_of(st.none(), st.integers(1, 12)), min_size=1, max_size=4),
        block_size=st.integers(1, 4),
        num_blocks=st.integers(2, 40),
        caching=st.booleans(),
    )
    def build(self, windows, block_size, num_blocks, caching):
        self.memory = KVCacheManager(
            num_blocks, kv_cache_groups=kv_cache_groups(windows, block_size), enable_caching=caching
        )
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}  # request -> its token ids so far
        self.skipped_at: dict[str, int] = {}  # request -> computed tokens at its last allocation
        self.next_id = 0

    @rule(length=st.integers(1, 30), vocab=st.integers(1, 3), data=st.data())
    def add(self, length, vocab, data):
        prompt = [data.draw(st.integers(0, vocab - 1)) for _ in range(length)]
        request = f"r{self.next_id}"
        self.next_id += 1
        computed = self.memory.get_computed_blocks(None, prompt)
        assert computed.num_tokens % self.block_size == 0 and computed.num_tokens < length
        free = self.memory.num_free_blocks
        gained = self.memory.allocate_slots(
            req(request), length - computed.num_tokens, prompt, new_computed_blocks=computed
        )
        if gained is None:
            assert self.memory.num_free_blocks == free and request not in self.memory
            return
        self.tokens[request] = prompt
        self.skipped_at[request] = computed.num_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 6))
    def grow(self, data, count):
        request = data.draw(st.sampled_from(sorted(self.tokens)))
        held = self.tokens[request]
        more = [*held, *range(count)]
        before = self.memory.get_block_ids(request)
        gained = self.memory.allocate_slots(req(request), count, more)
        after = self.memory.get_block_ids(request)
        if gained is None:
            assert [len(ids) for ids in after] == [len(ids) for ids in before]
        else:
            assert all(a[len(b) :] == g for a, b, g in zip(after, before, gained, strict=True))
            self.tokens[request] = more
        self.skipped_at[request] = len(held)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(sorted(self.tokens)))
        self.memory.free(request)
        del self.tokens[request], self.skipped_at[request]

    @invariant()
    def each_group_holds_what_its_window_needs(self):
        if not hasattr(self, "memory"):
            return
        holders: dict[int, int] = {}
        owner: dict[int, int] = {}  # block -> the group holding it: one group at a time
        for request, tokens in self.tokens.items():
            for manager, ids in zip(
                self.memory.coordinator.single_type_managers, self.memory.get_block_ids(request), strict=True
            ):
                for block_id in ids:
                    if block_id != NULL_BLOCK:
                        assert owner.setdefault(block_id, manager.group_id) == manager.group_id, block_id
                assert len(ids) == blocks_for_tokens(len(tokens), self.block_size)
                nulls = manager.spec.num_skipped_tokens(self.skipped_at[request]) // self.block_size
                if isinstance(manager, SlidingWindowManager):
                    assert ids[:nulls].count(NULL_BLOCK) == min(nulls, len(ids)) or nulls == 0
                assert NULL_BLOCK not in ids[nulls:]
                for block_id in ids[nulls:]:
                    holders[block_id] = holders.get(block_id, 0) + 1
        pool = self.memory.block_pool
        for block_id, count in holders.items():
            assert pool.ref_count(block_id) == count
        assert pool.num_free_blocks + len(holders) + 1 == self.memory.num_blocks
        assert NULL_BLOCK not in pool.free_block_ids


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.integers(1, 10), st.integers(1, 4))
def test_a_windows_hit_equals_a_brute_force_search(prompt, window, block_size):
    """The sliding manager's hit, with some blocks evicted, is the longest prefix whose window
    blocks are all cached, found by trying every length."""
    manager = sliding_manager(block_size=block_size, window=window, caching=True)
    manager.allocate_new_blocks("r", len(prompt))
    manager.start_chain("r", None, 0)
    manager.cache_blocks("r", prompt)
    blocks = manager.req_to_blocks["r"]
    for index in range(0, len(blocks), 3):
        manager.block_pool.prefix_cache.evict(blocks[index])
    cached = {i for i, b in enumerate(blocks) if manager.block_pool.prefix_cache.entry(b) is not None}
    pieces = full_blocks(prompt, block_size)
    need = manager.spec.blocks_for_hit
    expected = max(
        (n for n in range(len(pieces) + 1) if all(i in cached for i in range(max(0, n - need), n))),
        default=0,
    )
    assert manager.find_longest_cache_hit(pieces, chain_hashes(pieces), len(pieces))[1] == expected
