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
