"""Block bookkeeping that holds no tensor: blocks, block tables and their arithmetic, the free list,
the block manager, prefix caching and the manager's events.

Lessons 01 to 04 and 08. The state here is plain Python on block ids and token counts; the K/V
tensors live in :mod:`paged_kv.kv`, which :mod:`paged_kv.core.mapping`'s scatter and gather write
and read through a block table.
"""
