"""Pictures of a hybrid model's pool (lesson 13): a hybrid KV-cache manager's groups as one snapshot,
the null block drawn as what it is (grey, labelled, never a block the tables share), and a trace the
player plays."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from paged_kv import AllocatorSnapshot, BlockTable
from paged_kv.core.block_pool import NULL_BLOCK
from paged_kv.core.kv_cache_coordinator import group_names, table_name
from paged_kv.core.kv_cache_groups import kv_cache_groups
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.pictures.hybrid import HybridRecorder
from paged_kv.pictures.pool import NULL_FILL, block_tokens, render_allocator, seq_colour, snapshot_usage
from paged_kv.pictures.widgets import AllocationPlayer

pytestmark = pytest.mark.lesson13

SVG = "{http://www.w3.org/2000/svg}"


def req(request_id):
    return SimpleNamespace(request_id=request_id)


def picture(snapshot: AllocatorSnapshot, **options) -> ET.Element:
    return ET.fromstring(render_allocator(snapshot, inline=True, **options))


def pool_block(root: ET.Element, block_id: int) -> ET.Element:
    return next(g for g in root.iter(f"{SVG}g") if g.get("data-block") == str(block_id))


def table_boxes(root: ET.Element) -> dict[str, ET.Element]:
    """Each box of the block tables by its tooltip."""
    return {
        g.find(f"{SVG}title").text: g
        for g in root.iter(f"{SVG}g")
        if g.get("data-block") is None and g.find(f"{SVG}title") is not None
    }


def fills(element: ET.Element) -> list[str | None]:
    return [r.get("fill") for r in element.iter(f"{SVG}rect")]


def decoded(window: int = 8, prompt: int = 6, steps: int = 14, num_blocks: int = 16) -> KVCacheManager:
    """One request of Gemma 2's two groups (a window, full attention) in blocks of 4, past its window."""
    memory = KVCacheManager(num_blocks, kv_cache_groups=kv_cache_groups([window, None], 4))
    memory.allocate_slots(req("a"), prompt)
    for _ in range(steps):
        memory.allocate_slots(req("a"), 1)
    return memory


# ------------------------------------------------------------------------------ the snapshot


def test_groups_are_named_by_kind_and_numbered_only_when_a_kind_repeats():
    assert group_names(kv_cache_groups([8, None], 4)) == ("sw", "full")
    assert group_names(kv_cache_groups([8] * 5 + [None], 4)) == ("sw0", "sw1", "sw2", "sw3", "sw4", "full")
    assert group_names(kv_cache_groups([None, None], 4)) == ("full",)
    assert table_name("sw", "a") == "sw\N{MIDDLE DOT}a"


def test_a_hybrid_managers_snapshot_has_a_table_per_request_and_group_and_names_the_null_block():
    memory = decoded()  # 20 tokens: the window of the next token, 13..20, starts in block 3
    memory.allocate_slots(req("b"), 3)
    snapshot = memory.snapshot()
    assert list(snapshot.tables) == ["sw·a", "full·a", "sw·b", "full·b"]
    sliding, full = memory.get_block_ids("a")
    assert snapshot.tables["sw·a"] == BlockTable(list(sliding), 20)
    assert snapshot.tables["full·a"] == BlockTable(list(full), 20)
    assert sliding[:3] == (NULL_BLOCK,) * 3 and NULL_BLOCK not in full
    assert snapshot.null_block == NULL_BLOCK
    assert snapshot.free_block_ids == memory.block_pool.free_block_ids
    assert NULL_BLOCK not in snapshot.free_block_ids and snapshot.ref_counts[NULL_BLOCK] == 1
    # A copy: the memory going on changes nothing in it.
    memory.allocate_slots(req("a"), 4)
    assert snapshot.tables["sw·a"].block_ids == list(sliding)


def test_the_usage_leaves_out_the_null_block_and_the_entries_that_name_it():
    snapshot = decoded().snapshot()
    usage = snapshot_usage(snapshot)
    # sw holds 2 blocks (positions 12..19), full 5 (0..19): 7 of the 15 blocks besides the null block.
    assert (usage.used_blocks, usage.free_blocks) == (7, 8)
    assert (usage.allocated_tokens, usage.reserved_tokens) == (8 + 20, 28)
    assert NULL_BLOCK not in block_tokens(snapshot)
    assert usage.shared_blocks == 0  # three tables' entries name block 0: it is not shared


def test_a_snapshot_without_a_null_block_is_measured_as_before():
    tables = {"A": BlockTable([0, 1], 6)}
    plain = AllocatorSnapshot(4, 4, (2, 3), (1, 1, 0, 0), tables)
    assert plain.null_block is None
    assert snapshot_usage(plain).used_blocks == 2 and block_tokens(plain) == {0: 4, 1: 2}


# ------------------------------------------------------------------------------ the picture


def test_the_null_block_is_grey_and_labelled_in_the_pool_and_in_the_tables():
    snapshot = decoded().snapshot()
    markup = render_allocator(snapshot, inline=True)
    root = ET.fromstring(markup)
    null = pool_block(root, NULL_BLOCK)
    assert NULL_FILL in fills(null) and "null" in "".join(null.itertext())
    assert "the null block, never allocated nor freed" in null.find(f"{SVG}title").text
    assert not any(r.get("stroke-dasharray") for r in null.iter(f"{SVG}rect"))  # not "shared"
    boxes = table_boxes(root)
    nulls = [title for title in boxes if "the null block" in title]
    assert nulls == [
        f"seq sw·a: logical block {j} → the null block (block 0): its block left the window, "
        "and it is never read"
        for j in range(3)
    ]
    assert all(NULL_FILL in fills(boxes[title]) for title in nulls)
    real = boxes["seq sw·a: logical block 3 → physical block 7"]  # the window's first block
    assert seq_colour("sw·a") in fills(real)
    assert "the null block: stands in for blocks that left a window" in markup
    assert "used 7 / 15 blocks · 8 free · block 0, the null block, not counted" in markup


def test_a_request_keeps_its_colour_in_every_group():
    assert seq_colour(table_name("sw", "a")) == seq_colour(table_name("full", "a")) == seq_colour("a")
    assert seq_colour(table_name("sw", "b")) != seq_colour(table_name("sw", "a"))


def test_blocks_shared_through_the_prefix_cache_are_shared_and_the_null_block_still_is_not():
    memory = KVCacheManager(32, kv_cache_groups=kv_cache_groups([8, None], 4), enable_caching=True)
    prompt = list(range(20))
    memory.allocate_slots(req("a"), 20, prompt)
    for token in range(20, 26):  # the window slides: sliding blocks leave, null in their place
        memory.allocate_slots(req("a"), 1, [*prompt, *range(20, token + 1)])
    computed = memory.get_computed_blocks(None, prompt)
    memory.allocate_slots(req("b"), 4, prompt, new_computed_blocks=computed)
    snapshot = memory.snapshot()
    usage = snapshot_usage(snapshot)
    assert usage.shared_blocks > 0
    root = picture(snapshot)
    assert not any(r.get("stroke-dasharray") for r in pool_block(root, NULL_BLOCK).iter(f"{SVG}rect"))
    assert "0 \u00d7" not in "".join(pool_block(root, NULL_BLOCK).itertext())


# ------------------------------------------------------------------------------ the trace


def test_the_recorder_keeps_a_frame_per_call_with_what_each_group_took_and_gave_back():
    recorder = HybridRecorder(KVCacheManager(16, kv_cache_groups=kv_cache_groups([8, None], 4)))
    recorder.allocate("a", 6)
    recorder.decode("a", 6)
    captions = [frame.caption for frame in recorder.frames]
    assert captions[0] == "empty pool: 16 blocks of 4 slots, block 0 the null block; 2 groups (sw, full)"
    assert captions[1] == "a: 6-token prompt; sw takes [1, 2]; full takes [3, 4]"
    assert captions[2] == "a, token 7: fits in its last blocks"
    assert captions[4] == "a, token 9: sw takes block 5; full takes block 6"
    # Token 12's window is 4..11: block 1 (positions 0..3) leaves it.
    assert captions[7] == "a, token 12: sw frees block 1 (out of the window; null in its place)"
    assert recorder.frames[7].highlight == (1,)
    assert recorder.frames[7].snapshot.tables["sw·a"].block_ids == [0, 2, 5]
    assert [f.event for f in recorder.frames] == ["start", "allocate", *["append"] * 6]
    assert all(f.snapshot.null_block == NULL_BLOCK for f in recorder.frames)
    freed = recorder.free("a")
    assert (
        recorder.frames[-1].caption
        == f"a finished: blocks {freed} back to the free list, each group's last block first"
    )
    assert NULL_BLOCK not in freed and recorder.memory.num_free_blocks == 15


def test_a_block_freed_from_the_window_and_taken_again_at_once_is_still_reported():
    # 4 blocks: the null block and 3. One sliding group, window 4, blocks of 2: the pool is full when
    # token 7 needs a block, and the block the window just left is the one it gets.
    recorder = HybridRecorder(KVCacheManager(4, kv_cache_groups=kv_cache_groups([4], 2)))
    recorder.allocate("a", 6)
    recorder.decode("a", 1)
    assert (
        recorder.frames[-1].caption
        == "a, token 7: sw takes block 1; sw frees block 1 (out of the window; null in its place)"
    )
    assert recorder.frames[-1].snapshot.tables["sw·a"].block_ids == [0, 2, 3, 1]


def test_a_refused_allocation_raises_and_records_nothing():
    recorder = HybridRecorder(KVCacheManager(5, kv_cache_groups=kv_cache_groups([8, None], 4)))
    recorder.allocate("a", 8)  # 2 + 2 blocks: the pool is full
    frames = len(recorder.frames)
    with pytest.raises(ValueError, match="refused: too few free blocks"):
        recorder.allocate("b", 1)
    with pytest.raises(ValueError, match="holds blocks already"):
        recorder.allocate("a", 1)
    with pytest.raises(ValueError, match="holds no blocks"):
        recorder.decode("nobody")
    assert len(recorder.frames) == frames and "b" not in recorder.memory


def test_the_recorder_starts_from_an_empty_memory():
    memory = decoded()
    with pytest.raises(ValueError, match="no request yet"):
        HybridRecorder(memory)
    with pytest.raises(ValueError, match="KVCacheManager"):
        HybridRecorder(object())


def test_the_player_plays_a_hybrid_trace():
    recorder = HybridRecorder(KVCacheManager(16, kv_cache_groups=kv_cache_groups([8, None], 4)))
    recorder.allocate("a", 6)
    recorder.decode("a", 10)
    player = AllocationPlayer(recorder.frames)
    assert len(player.stack.children) == 12
    assert "null" in player.frame_html(11) and "a, token 16" in player.frame_caption(11)
    still = player._repr_mimebundle_()["text/html"]
    assert "data:image/svg+xml;base64," in still
