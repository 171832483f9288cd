"""Exercise 12's wrong kernels, each the package's kernel with one mistake written into its source
(:func:`paged_kv.checks.lesson12.mistaken`); the ``lesson12_*.py`` files import one each as the
learner's ``paged_attention_kernel`` (the grader keeps a file's imports, not its other assignments)."""

from paged_kv.checks.lesson12 import CAUSAL, LIVE, LOOP, mistaken

# The running maximum is updated, but the running total and acc are not multiplied by exp(m_old - m_new).
max_not_rescaled = mistaken(
    ("total = total * rescale +", "total = total +"), ("acc = acc * rescale[:, None] +", "acc = acc +")
)
# The live slots of a block counted from position 1: the last token of each sequence is never loaded.
off_by_one = mistaken((LIVE, "live = (slots < BLOCK_SIZE) & (kv_pos + 1 < seq_len)"))
# Only the padding to a power of two is masked: the last block's slots past seq_len are loaded.
tail_unmasked = mistaken((LIVE, "live = slots < BLOCK_SIZE"))
# Query head q reads KV head q % num_kv_heads: program kv_head takes heads kv_head + i * num_kv_heads.
wrong_kv_head = mistaken(
    ("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head + (rows % GROUP) * tl.num_programs(1)")
)
# A sequence's row found with the entry stride: every sequence but the first reads the first one's row.
wrong_table_row = mistaken(("seq * table_stride_seq", "seq * table_stride_entry"))
# The live mask written <= seq_len: the slot at position seq_len, past the sequence, is loaded.
live_le_seq_len = mistaken((LIVE, "live = (slots < BLOCK_SIZE) & (kv_pos <= seq_len)"))
# The block loop's bound rounded down: a partly full last block is never visited.
loop_rounds_down = mistaken((LOOP, "kv_len // BLOCK_SIZE"))
# The block loop's bound one short: the last block is never visited.
loop_one_short = mistaken((LOOP, f"{LOOP} - 1"))
# The block loop's bound one long: the output is right (the extra block has no slot any query sees),
# but the kernel reads the table entry after the blocks it needs.
loop_one_long = mistaken((LOOP, f"{LOOP} + 1"))
# The bound rounded down, plus one: one block too many when the last block is full, right otherwise.
loop_floor_plus_one = mistaken((LOOP, "kv_len // BLOCK_SIZE + 1"))
# K or V of slot s read at slot s + 1 or s - 1 of the block: scores or values one token off.
k_slot_plus_one = mistaken(("slots[:, None] * k_stride_slot", "(slots[:, None] + 1) * k_stride_slot"))
k_slot_minus_one = mistaken(("slots[:, None] * k_stride_slot", "(slots[:, None] - 1) * k_stride_slot"))
v_slot_plus_one = mistaken(("slots[:, None] * v_stride_slot", "(slots[:, None] + 1) * v_stride_slot"))
v_slot_minus_one = mistaken(("slots[:, None] * v_stride_slot", "(slots[:, None] - 1) * v_stride_slot"))
# The causal mask written < query_pos: no query sees its own token.
causal_excludes_own = mistaken((CAUSAL, "kv_pos[None, :] < query_pos[:, None]"))
# No causal mask: a prompt's or a chunk's query tokens see the tokens after them in their tile.
not_causal = mistaken(("scores = tl.where(visible,", "scores = tl.where(live[None, :],"))
# A query's position counted from 0, not from the context_len tokens cached before it.
position_from_zero = mistaken(("query_pos = context_len + token", "query_pos = token"))
# The queries read at row i of the packed batch, not query_start + i: every sequence reads the first's.
wrong_query_row = mistaken(
    ("query_ptr\n        + (query_start + token)[:, None]", "query_ptr\n        + token[:, None]")
)
# A row's token and head swapped: row r taken as token r % GROUP and head r // GROUP.
rows_swapped = mistaken(
    ("token = tile * QUERY_TILE + rows // GROUP", "token = tile * QUERY_TILE + rows % GROUP"),
    ("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head * GROUP + rows // GROUP"),
)
# Every tile takes the first QUERY_TILE tokens of its sequence: a prompt's later tokens are never computed.
first_tile_only = mistaken(("token = tile * QUERY_TILE + rows // GROUP", "token = rows // GROUP"))
# The real rows masked with token <= query_len: a sequence's last tile also stores the row after its last
# query token, the next sequence's first row (which that sequence's program, run after it by Triton's
# interpreter, overwrites: only the store seen per program shows it) or a row past the batch.
rows_past_query_len = mistaken(("& (token < query_len))", "& (token <= query_len))"))
# The rows masked with rows <= QUERY_TILE * GROUP: where that is not a power of two, the padding's first
# row is real too, the next tile's first token (head kv_head * GROUP), stored from a kernel state that
# never saw that token's own position. Triton's interpreter runs the next tile after, which overwrites it.
rows_le_tile = mistaken(("(rows < QUERY_TILE * GROUP)", "(rows <= QUERY_TILE * GROUP)"))
