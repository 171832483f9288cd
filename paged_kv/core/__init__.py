"""Block bookkeeping that holds no tensor: blocks, block tables and their arithmetic, the free list,
prefix caching, the block pool, and the two managers over it: the engine's ``KVCacheManager``
(through a KV-cache coordinator and one single-type manager per KV-cache group, vLLM's block stack)
and the lessons' ``BlockManager``, with the changes it tells the pictures' recorder.

Lessons 01 to 04, 07 to 09 and 13. The state here is plain Python on block ids and token counts; the K/V
tensors live in :mod:`paged_kv.kv`, which :mod:`paged_kv.core.mapping`'s scatter and gather write
and read through a block table.
"""
