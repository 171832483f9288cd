"""Swapping a sequence's K/V to host memory and back (paged_kv.kv.swap, PagedKVCache.swap_out / swap_in).

The examples check the round trip on every layer, that the blocks really go back to the pool and
come back as other blocks, that a swapped-in sequence decodes the same tokens as one never swapped,
and that every bad call fails with a clear error and changes nothing. A hypothesis state machine
then mixes adds, appends, swaps out and in and frees against a contiguous reference.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import OutOfBlocksError, UnknownSequenceError, blocks_for_tokens
from paged_kv.kv.swap import SwappedKV, to_host
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT

from .helpers import max_examples

pytestmark = pytest.mark.lesson11

CONFIG = GPTConfig(num_layers=3, num_heads=2, head_dim=4, max_len=64)
BLOCK_SIZE = 4


def layer_kv(config: GPTConfig, num_tokens: int, layer: int, first: int = 0, device="cpu"):
    """K and V for one layer whose every element is distinct across tokens, heads, dims and layers."""
    count = num_tokens * config.num_heads * config.head_dim
    start = 1 + layer * 10_000 + first * config.num_heads * config.head_dim
    k = torch.arange(start, start + count, dtype=torch.float32).view(num_tokens, config.num_heads, -1)
    return k.to(device), -k.to(device)


def filled_cache(num_tokens: int, num_blocks: int = 8, device="cpu") -> PagedKVCache:
    """A cache holding sequence ``"s"`` of ``num_tokens`` tokens, its K/V written in every layer."""
    cache = PagedKVCache(CONFIG, num_blocks, BLOCK_SIZE, device)
    cache.add_sequence("s", num_tokens)
    for layer in range(CONFIG.num_layers):
        cache.write_prompt(layer, "s", *layer_kv(CONFIG, num_tokens, layer, device=device))
    return cache


@contextmanager
def unchanged_cache(cache: PagedKVCache):
    """The manager and every layer's K/V end the block exactly as they started."""
    before = cache.manager.snapshot()
    k_before = [k.clone() for k in cache.storage.k_caches]
    v_before = [v.clone() for v in cache.storage.v_caches]
    yield
    assert cache.manager.snapshot() == before
    assert all(torch.equal(k, b) for k, b in zip(cache.storage.k_caches, k_before, strict=True))
    assert all(torch.equal(v, b) for v, b in zip(cache.storage.v_caches, v_before, strict=True))


@pytest.mark.parametrize("num_tokens", [1, 4, 6, 9])
def test_swap_out_copies_every_layer_to_the_host_and_frees_the_blocks(num_tokens: int, device) -> None:
    cache = filled_cache(num_tokens, device=device)
    saved = cache.swap_out("s")
    assert isinstance(saved, SwappedKV) and saved.num_tokens == num_tokens
    for layer in range(CONFIG.num_layers):
        k, v = layer_kv(CONFIG, num_tokens, layer)
        assert saved.k[layer].device.type == "cpu" and saved.v[layer].device.type == "cpu"
        assert torch.equal(saved.k[layer], k) and torch.equal(saved.v[layer], v)
    assert saved.nbytes == 2 * CONFIG.num_layers * num_tokens * CONFIG.d_model * 4
    assert cache.num_free_blocks == 8 and "s" not in cache.manager


@pytest.mark.parametrize("num_tokens", [1, 4, 6, 9])
def test_swap_in_restores_the_kv_in_other_blocks(num_tokens: int, device) -> None:
    cache = filled_cache(num_tokens, device=device)
    before = cache.manager.get_block_table("s").block_ids
    saved = cache.swap_out("s")
    cache.add_sequence("other", 2 * BLOCK_SIZE)  # takes the blocks "s" had first
    cache.swap_in("s", saved)
    after = cache.manager.get_block_table("s").block_ids
    assert len(after) == blocks_for_tokens(num_tokens, BLOCK_SIZE)
    assert not set(after) & set(cache.manager.get_block_table("other").block_ids)
    assert after != before[: len(after)]  # new physical blocks, same logical content
    assert cache.manager.sequence_length("s") == num_tokens
    assert cache.num_free_blocks == 8 - 2 - len(after)
    for layer in range(CONFIG.num_layers):  # one table for every layer's K/V
        k, v = cache.read_kv(layer, "s")
        expected_k, expected_v = layer_kv(CONFIG, num_tokens, layer, device=device)
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_a_sequence_swapped_out_and_in_decodes_what_it_would_have(device) -> None:
    model = TinyGPT(CONFIG, seed=2).to(device)
    prompt = [5, 17, 99, 3, 250, 8]
    expected = generate(model, [prompt], 9, cache="contiguous").tokens[0]
    cache = PagedKVCache(CONFIG, 10, BLOCK_SIZE, device)
    with torch.no_grad():
        cache.add_sequence("s", len(prompt))
        tokens = [int(model.prefill(torch.tensor(prompt, device=device), "s", cache)[-1].argmax())]
        for step in range(8):
            if step == 3:  # mid-way: swap out, let another sequence take the blocks, swap back in
                saved = cache.swap_out("s")
                cache.add_sequence("intruder", 9)
                model.prefill(torch.arange(9, device=device), "intruder", cache)
                cache.swap_in("s", saved)
            last = torch.tensor([tokens[-1]], device=device)
            tokens.append(int(model.decode_step(last, ["s"], cache)[0].argmax()))
    assert tokens == expected


def test_to_host_copies_to_the_cpu_in_pinned_memory_from_cuda(device) -> None:
    tensor = torch.arange(6.0, device=device).view(2, 3)
    host = to_host(tensor)
    assert host.device.type == "cpu" and torch.equal(host, tensor.cpu())
    assert host.data_ptr() != tensor.data_ptr()  # a copy, even from the CPU
    if device.type == "cuda":
        assert host.is_pinned()


def test_swap_out_of_an_unknown_sequence_is_a_key_error_and_changes_nothing() -> None:
    cache = filled_cache(5)
    with unchanged_cache(cache), pytest.raises(UnknownSequenceError):
        cache.swap_out("nobody")


def test_swap_in_with_too_few_free_blocks_raises_and_changes_nothing() -> None:
    cache = filled_cache(9)  # 3 blocks of 8
    saved = cache.swap_out("s")
    cache.add_sequence("big", 6 * BLOCK_SIZE)  # 2 blocks left, 3 needed
    with unchanged_cache(cache), pytest.raises(OutOfBlocksError, match=r"needs 3 free blocks but only 2"):
        cache.swap_in("s", saved)
    cache.free("big")
    cache.swap_in("s", saved)  # and it works once they are free
    assert cache.manager.sequence_length("s") == 9


def test_bad_swap_ins_raise_value_error_naming_the_problem_and_change_nothing() -> None:
    cache = filled_cache(5)
    saved = cache.swap_out("s")
    cache.add_sequence("t", 3)
    other = PagedKVCache(GPTConfig(num_layers=3, num_heads=1, head_dim=8, max_len=64), 8, BLOCK_SIZE)
    other.add_sequence("x", 5)
    fewer_layers = PagedKVCache(GPTConfig(num_layers=2, num_heads=2, head_dim=4, max_len=64), 8, BLOCK_SIZE)
    fewer_layers.add_sequence("x", 5)
    half = PagedKVCache(CONFIG, 8, BLOCK_SIZE, dtype=torch.float16)
    half.add_sequence("x", 5)
    cases = [
        ("t", saved, "already allocated"),
        ("u", (saved.k, saved.v), "saved must be a SwappedKV"),
        ("u", other.swap_out("x"), r"saved\.k\[0\].*different cache"),
        ("u", half.swap_out("x"), r"float16.*different cache"),
        ("u", fewer_layers.swap_out("x"), "2 layers.*3 layers"),
        (["unhashable"], saved, "seq_id must be hashable"),
    ]
    for seq_id, bad, match in cases:
        with unchanged_cache(cache), pytest.raises(ValueError, match=match):
            cache.swap_in(seq_id, bad)


# ------------------------------------------------------------------------- the state machine

NUM_BLOCKS = 10


class SwapMachine(RuleBasedStateMachine):
    """Sequences come, grow, are swapped out and in, and leave; ``self.expected`` is the reference."""

    device = "cpu"

    @initialize()
    def start(self) -> None:
        self.cache = PagedKVCache(CONFIG, NUM_BLOCKS, BLOCK_SIZE, self.device)
        self.expected: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # live: K/V per layer
        self.swapped: dict[int, tuple[SwappedKV, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.next_id = 0

    def fresh(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V per layer never seen before, so a misplaced or lost token shows."""
        first, self.next_id = self.next_id * 1000, self.next_id + 1
        return [layer_kv(CONFIG, num_tokens, layer, first, self.device) for layer in range(CONFIG.num_layers)]

    def free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @rule(num_tokens=st.integers(1, 3 * BLOCK_SIZE))
    def add(self, num_tokens: int) -> None:
        if blocks_for_tokens(num_tokens, BLOCK_SIZE) > self.free_blocks():
            return
        seq_id = self.next_id
        kv = self.fresh(num_tokens)
        self.cache.add_sequence(seq_id, num_tokens)
        for layer, (k, v) in enumerate(kv):
            self.cache.write_prompt(layer, seq_id, k, v)
        self.expected[seq_id] = kv

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data())
    def append_one(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        if self.cache.needs_new_block(seq_id) and not self.free_blocks():
            return
        self.cache.append([seq_id])
        for layer, (new_k, new_v) in enumerate(self.fresh(1)):
            self.cache.attend(layer, [seq_id], new_k, new_k, new_v)  # stores the new token's K/V
            k, v = self.expected[seq_id][layer]
            self.expected[seq_id][layer] = (torch.cat([k, new_k]), torch.cat([v, new_v]))

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        self.swapped[seq_id] = (self.cache.swap_out(seq_id), self.expected.pop(seq_id))

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        saved, kv = self.swapped[seq_id]
        if blocks_for_tokens(saved.num_tokens, BLOCK_SIZE) > self.free_blocks():
            with unchanged_cache(self.cache), pytest.raises(OutOfBlocksError):
                self.cache.swap_in(seq_id, saved)
            return
        self.cache.swap_in(seq_id, saved)
        self.expected[seq_id] = kv
        del self.swapped[seq_id]

    @precondition(lambda self: bool(self.expected))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.expected)))
        self.cache.free(seq_id)
        del self.expected[seq_id]

    @invariant()
    def live_sequences_read_back_what_was_written(self) -> None:
        for seq_id, kv in self.expected.items():
            for layer, (k, v) in enumerate(kv):
                read_k, read_v = self.cache.read_kv(layer, seq_id)
                assert torch.equal(read_k, k) and torch.equal(read_v, v), seq_id

    @invariant()
    def swapped_sequences_hold_no_blocks_and_every_layer_agrees(self) -> None:
        held = sum(blocks_for_tokens(len(kv[0][0]), BLOCK_SIZE) for kv in self.expected.values())
        assert self.cache.num_free_blocks == NUM_BLOCKS - held
        assert set(self.cache.manager.seq_ids) == set(self.expected)
        for saved, kv in self.swapped.values():
            assert all(torch.equal(s, k.cpu()) for s, (k, _) in zip(saved.k, kv, strict=True))


TestSwapOnCPU = SwapMachine.TestCase
# A third of the profile's runs (100 under ci): the sequencing of swaps among adds, appends, forks,
# frees and preemptions is explored by tests/test_stateful.py's machines, through the same
# paged_kv.kv.swap functions this cache calls; this machine adds the model cache's layers.
TestSwapOnCPU.settings = settings(max_examples=max_examples(20))


class SwapOnCUDAMachine(SwapMachine):
    device = "cuda"


TestSwapOnCUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")(
    SwapOnCUDAMachine.TestCase
)
