"""Exercise 04's given part of ``BlockManager`` (its state, ``allocate_for_sequence``), for the wrong
``append_block_to_sequence`` implementations to build on."""

from collections import deque

from paged_kv import Block, BlockTable, OutOfBlocksError, blocks_for_tokens


class GivenBlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_blocks = deque(range(num_blocks))
        self.sequence_block_tables = {}

    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.sequence_block_tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        if needed > len(self.free_blocks):
            raise OutOfBlocksError(needed=needed, free=len(self.free_blocks))
        block_ids = [self.free_blocks.popleft() for _ in range(needed)]
        for block_id in block_ids:
            self.blocks[block_id].ref_count = 1
        self.sequence_block_tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)
