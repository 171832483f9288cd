"""BlockAllocator: the free list and the ref counts (lesson 02)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv import BlockAllocator, OutOfBlocksError
from paged_kv.core.block_allocator import DETACHED, FreeKVCacheBlockQueue

pytestmark = pytest.mark.lesson02


def test_a_new_pool_is_all_free_in_order():
    pool = BlockAllocator(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 0
    assert pool.free_block_ids == (0, 1, 2, 3, 4)
    assert all(pool.is_free(b) and pool.ref_count(b) == 0 for b in range(5))


def test_allocate_takes_the_head_of_the_free_list():
    pool = BlockAllocator(5)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.free_block_ids == (3, 4)
    assert pool.ref_count(0) == 1
    assert not pool.is_free(0)


def test_free_returns_the_block_to_the_tail():
    pool = BlockAllocator(4)
    first, second = pool.allocate(), pool.allocate()
    assert pool.free(first) is True
    assert pool.free_block_ids == (2, 3, first)
    assert pool.num_used_blocks == 1
    pool.free(second)
    assert pool.free_block_ids == (2, 3, first, second)


def test_a_shared_block_returns_only_when_its_last_holder_frees_it():
    pool = BlockAllocator(2)
    block = pool.allocate()
    assert pool.add_ref(block) == 2
    assert pool.free(block) is False
    assert pool.ref_count(block) == 1
    assert not pool.is_free(block)
    assert pool.free(block) is True
    assert pool.is_free(block)
    assert pool.free_block_ids == (1, block)


def test_double_free_is_an_error_and_changes_nothing():
    pool = BlockAllocator(3)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(ValueError, match="already free"):
        pool.free(block)
    assert pool.free_block_ids == (1, 2, 0)


def test_freeing_a_never_allocated_block_is_an_error():
    with pytest.raises(ValueError, match="block_id 2 is already free"):
        BlockAllocator(3).free(2)


@pytest.mark.parametrize("bad", [-1, 3, 1.0, "0", True])
def test_a_bad_block_id_names_the_argument(bad):
    pool = BlockAllocator(3)
    pool.allocate_blocks(3)
    for method in (pool.free, pool.add_ref, pool.ref_count, pool.is_free):
        with pytest.raises(ValueError, match="block_id"):
            method(bad)
    assert pool.num_used_blocks == 3
    assert all(pool.ref_count(b) == 1 for b in range(3))


def test_add_ref_on_a_free_block_is_an_error():
    with pytest.raises(ValueError, match="already free"):
        BlockAllocator(2).add_ref(0)


def test_out_of_blocks_says_what_was_needed_and_what_is_free():
    pool = BlockAllocator(2)
    pool.allocate_blocks(2)
    with pytest.raises(OutOfBlocksError, match="needs 1 free block but only 0 are free") as caught:
        pool.allocate()
    assert isinstance(caught.value, RuntimeError)
    assert (caught.value.needed, caught.value.free) == (1, 0)


def test_allocate_blocks_is_all_or_nothing():
    pool = BlockAllocator(4)
    pool.allocate()
    with pytest.raises(OutOfBlocksError) as caught:
        pool.allocate_blocks(4)
    assert (caught.value.needed, caught.value.free) == (4, 3)
    assert pool.free_block_ids == (1, 2, 3)
    assert pool.allocate_blocks(3) == [1, 2, 3]
    assert pool.allocate_blocks(0) == []


def test_can_allocate():
    pool = BlockAllocator(3)
    assert pool.can_allocate() and pool.can_allocate(3) and pool.can_allocate(0)
    assert not pool.can_allocate(4)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.can_allocate(-1)


@pytest.mark.parametrize("bad", [0, -4, 2.5, None])
def test_the_pool_needs_a_positive_whole_size(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)


def test_repr_shows_the_free_count():
    pool = BlockAllocator(4)
    pool.allocate()
    assert repr(pool) == "BlockAllocator(free=3/4)"


class BlockAllocatorMachine(RuleBasedStateMachine):
    """BlockAllocator against a reference model: a list of ref counts and a FIFO list of free ids."""

    NUM_BLOCKS = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockAllocator(self.NUM_BLOCKS)
        self.refs = [0] * self.NUM_BLOCKS
        self.free_list = list(range(self.NUM_BLOCKS))

    def used(self) -> list[int]:
        return [b for b, count in enumerate(self.refs) if count]

    @rule()
    def allocate(self):
        if not self.free_list:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate()
            return
        expected = self.free_list.pop(0)
        assert self.pool.allocate() == expected
        self.refs[expected] = 1

    @rule(n=st.integers(0, 8))
    def allocate_blocks(self, n):
        if n > len(self.free_list):
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate_blocks(n)
            return
        expected, self.free_list = self.free_list[:n], self.free_list[n:]
        assert self.pool.allocate_blocks(n) == expected
        for b in expected:
            self.refs[b] = 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def share(self, data):
        block = data.draw(st.sampled_from(self.used()))
        self.refs[block] += 1
        assert self.pool.add_ref(block) == self.refs[block]

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def free(self, data):
        block = data.draw(st.sampled_from(self.used()))
        self.refs[block] -= 1
        released = self.refs[block] == 0
        if released:
            self.free_list.append(block)
        assert self.pool.free(block) is released

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def double_free(self, block):
        if self.refs[block] == 0:
            with pytest.raises(ValueError):
                self.pool.free(block)

    @invariant()
    def matches_the_model(self):
        assert self.pool.free_block_ids == tuple(self.free_list)
        assert [self.pool.ref_count(b) for b in range(self.NUM_BLOCKS)] == self.refs
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.NUM_BLOCKS
        assert self.pool.num_used_blocks == len(self.used())
        assert self.pool.num_shared_blocks == sum(r > 1 for r in self.refs)


TestBlockAllocatorMachine = BlockAllocatorMachine.TestCase


# ------------------------------------------------------------- the doubly linked free list


def links_are_consistent(queue: FreeKVCacheBlockQueue) -> None:
    """The structural invariants of a FreeKVCacheBlockQueue, checked by walking its links both ways."""
    forward, backward = list(queue), list(reversed(queue))
    assert forward == backward[::-1]
    assert len(forward) == len(set(forward)) == len(queue)
    num_blocks = queue._sentinel
    for block_id in range(num_blocks):
        if block_id in forward:
            assert queue._next[queue._prev[block_id]] == block_id
            assert queue._prev[queue._next[block_id]] == block_id
        else:
            assert queue._prev[block_id] == queue._next[block_id] == DETACHED
            assert block_id not in queue


def test_a_new_queue_holds_every_block_in_order():
    queue = FreeKVCacheBlockQueue(4)
    assert list(queue) == [0, 1, 2, 3]
    assert list(reversed(queue)) == [3, 2, 1, 0]
    assert len(queue) == 4 and 2 in queue
    assert repr(queue) == "FreeKVCacheBlockQueue([0, 1, 2, 3])"
    links_are_consistent(queue)


@pytest.mark.parametrize(("removed", "left"), [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]), (4, [0, 1, 2, 3])])
def test_remove_takes_a_block_from_the_head_the_middle_or_the_tail(removed, left):
    queue = FreeKVCacheBlockQueue(5)
    queue.remove(removed)
    assert list(queue) == left
    assert removed not in queue
    links_are_consistent(queue)
    queue.append(removed)  # back at the tail
    assert list(queue) == [*left, removed]
    links_are_consistent(queue)


def test_popleft_and_append_keep_fifo_order_until_empty():
    queue = FreeKVCacheBlockQueue(3)
    queue.remove(1)
    queue.append(1)
    assert [queue.popleft() for _ in range(3)] == [0, 2, 1]
    assert len(queue) == 0 and list(queue) == [] and list(reversed(queue)) == []
    links_are_consistent(queue)
    with pytest.raises(IndexError, match="empty"):
        queue.popleft()
    queue.append(2)
    assert list(queue) == [2]
    links_are_consistent(queue)


def test_appendleft_puts_a_block_at_the_head_of_any_queue():
    queue = FreeKVCacheBlockQueue(4)
    for block_id in (2, 0, 3, 1):
        queue.remove(block_id)
    queue.appendleft(1)  # into the empty ring
    queue.appendleft(3)
    queue.append(0)
    assert list(queue) == [3, 1, 0] and list(reversed(queue)) == [0, 1, 3]
    links_are_consistent(queue)
    assert queue.popleft() == 3
    queue.appendleft(2)
    assert [queue.popleft() for _ in range(3)] == [2, 1, 0]
    links_are_consistent(queue)


def test_removing_the_only_block_leaves_an_empty_ring():
    queue = FreeKVCacheBlockQueue(1)
    queue.remove(0)
    assert list(queue) == [] and len(queue) == 0
    queue.append(0)
    assert queue.popleft() == 0
    links_are_consistent(queue)


def test_queue_errors_name_the_block_and_change_nothing():
    queue = FreeKVCacheBlockQueue(4)
    queue.remove(1)
    with pytest.raises(ValueError, match="block_id 2 is already on the free list"):
        queue.append(2)
    with pytest.raises(ValueError, match="block_id 3 is already on the free list"):
        queue.appendleft(3)
    with pytest.raises(ValueError, match="block_id 1 is not on the free list"):
        queue.remove(1)
    for bad in (-1, 4, True, 1.0, "0"):
        for method in (queue.append, queue.appendleft, queue.remove):
            with pytest.raises(ValueError, match="block_id"):
                method(bad)
        assert bad not in queue
    assert list(queue) == [0, 2, 3]
    links_are_consistent(queue)


def test_take_removes_a_free_block_from_the_middle_and_keeps_the_order():
    pool = BlockAllocator(6)
    pool.take(3)
    assert pool.free_block_ids == (0, 1, 2, 4, 5)
    assert pool.ref_count(3) == 1 and not pool.is_free(3)
    assert pool.num_used_blocks == 1
    assert pool.allocate() == 0
    assert pool.free(3) is True
    assert pool.free_block_ids == (1, 2, 4, 5, 3)
    pool.take(5)
    assert pool.free_block_ids == (1, 2, 4, 3)


def test_take_of_a_used_or_unknown_block_is_an_error_and_changes_nothing():
    pool = BlockAllocator(3)
    used = pool.allocate()
    with pytest.raises(ValueError, match="block_id 0 is in use"):
        pool.take(used)
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match="block_id"):
            pool.take(bad)
    assert pool.free_block_ids == (1, 2)
    assert [pool.ref_count(b) for b in range(3)] == [1, 0, 0]


class BlockAllocatorWithTakeMachine(BlockAllocatorMachine):
    """The machine above plus ``take`` (removal from anywhere in the free list) and the link invariants."""

    @precondition(lambda self: bool(self.free_list))
    @rule(data=st.data())
    def take(self, data):
        block = data.draw(st.sampled_from(self.free_list))
        self.free_list.remove(block)
        self.refs[block] = 1
        self.pool.take(block)

    @rule(block=st.integers(0, BlockAllocatorMachine.NUM_BLOCKS - 1))
    def take_a_used_block(self, block):
        if self.refs[block]:
            with pytest.raises(ValueError):
                self.pool.take(block)

    @invariant()
    def the_links_hold(self):
        links_are_consistent(self.pool.free_block_queue)


TestBlockAllocatorWithTakeMachine = BlockAllocatorWithTakeMachine.TestCase


def test_num_shared_blocks_counts_blocks_with_more_than_one_holder():
    pool = BlockAllocator(4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.num_shared_blocks == 0
    pool.add_ref(a)
    pool.add_ref(a)  # three holders: still one shared block
    pool.add_ref(b)
    assert pool.num_shared_blocks == 2
    pool.free(a)
    assert pool.num_shared_blocks == 2  # a keeps two holders
    pool.free(a)
    pool.free(b)
    assert pool.num_shared_blocks == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free(pool.allocate() + 1)  # a free block: nothing changes
    assert pool.num_shared_blocks == 0
