"""Exercise 12's wrong kernels, each the package's kernel with one mistake written into its source
(:func:`paged_kv.checks.lesson12.mistaken`); the ``lesson12_*.py`` files import one each as the
learner's ``paged_decode_kernel`` (the grader keeps a file's imports, not its other assignments)."""

from paged_kv.checks.lesson12 import mistaken

# The running maximum is updated, but the running total and acc are not multiplied by exp(m_old - m_new).
max_not_rescaled = mistaken(
    ("total = total * rescale +", "total = total +"), ("acc = acc * rescale[:, None] +", "acc = acc +")
)
# The live slots of a block counted from position 1: the last token of each sequence is never attended.
off_by_one = mistaken(("j * BLOCK_SIZE + slots < context_len", "j * BLOCK_SIZE + slots < context_len - 1"))
# Only the padding to a power of two is masked: the last block's slots past context_len are attended.
tail_unmasked = mistaken(
    ("(slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < context_len)", "slots < BLOCK_SIZE")
)
# Query head q reads KV head q % num_kv_heads: program kv_head takes heads kv_head + i * num_kv_heads.
wrong_kv_head = mistaken(
    ("heads = kv_head * GROUP + members", "heads = kv_head + members * tl.num_programs(1)")
)
# A sequence's row found with the entry stride: every sequence but the first reads the first one's row.
wrong_table_row = mistaken(("seq * table_stride_seq", "seq * table_stride_entry"))
# The live mask written <= context_len: the slot at position context_len, past the sequence, is attended.
live_le_context_len = mistaken(
    ("j * BLOCK_SIZE + slots < context_len", "j * BLOCK_SIZE + slots <= context_len")
)
# The block loop's bound rounded down: a partly full last block is never visited.
loop_rounds_down = mistaken(("tl.cdiv(context_len, BLOCK_SIZE)", "context_len // BLOCK_SIZE"))
# The block loop's bound one short: the last block is never visited.
loop_one_short = mistaken(("tl.cdiv(context_len, BLOCK_SIZE)", "tl.cdiv(context_len, BLOCK_SIZE) - 1"))
# The block loop's bound one long: the output is right (the extra block has no live slot), but the
# kernel reads the table entry after the sequence's blocks.
loop_one_long = mistaken(("tl.cdiv(context_len, BLOCK_SIZE)", "tl.cdiv(context_len, BLOCK_SIZE) + 1"))
# The bound rounded down, plus one: one block too many when the last block is full, right otherwise.
loop_floor_plus_one = mistaken(("tl.cdiv(context_len, BLOCK_SIZE)", "context_len // BLOCK_SIZE + 1"))
# K or V of slot s read at slot s + 1 or s - 1 of the block: scores or values one token off.
k_slot_plus_one = mistaken(("slots[:, None] * k_stride_slot", "(slots[:, None] + 1) * k_stride_slot"))
k_slot_minus_one = mistaken(("slots[:, None] * k_stride_slot", "(slots[:, None] - 1) * k_stride_slot"))
v_slot_plus_one = mistaken(("slots[:, None] * v_stride_slot", "(slots[:, None] + 1) * v_stride_slot"))
v_slot_minus_one = mistaken(("slots[:, None] * v_stride_slot", "(slots[:, None] - 1) * v_stride_slot"))
