"""Exercise 04 graded on the package: ``needs_new_block`` is the boundary rule of :mod:`paged_kv.mapping`
(the one ``PagedKVCacheAllocator.needs_new_block`` applies to a sequence), and ``decode_step`` and
``finish_and_admit`` are the scheduler steps of :mod:`paged_kv.scheduling`, which work on the
package's cache.
"""

from paged_kv.mapping import needs_new_block
from paged_kv.scheduling import decode_step, finish_and_admit

__all__ = ["decode_step", "finish_and_admit", "needs_new_block"]
