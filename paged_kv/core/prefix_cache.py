"""Prefix caching: a new prompt reuses the K/V blocks of a prefix an earlier prompt computed (lesson 08).

The K/V of a token depend on the token and on every token before it, so a block of a prompt is
identified by its own token ids *and* the whole prefix before it. As vLLM does, the identity is a
chain of hashes, one per **full** block of the prompt::

    hash_0 = block_hash(ROOT_HASH, tokens of block 0)
    hash_i = block_hash(hash_{i-1}, tokens of block i)

Only full blocks are hashed and shared; the partly full last block of a prompt stays private while
it fills. A sequence whose appended token ids are given keeps its place in the chain
(:class:`HashChain`), so a block that fills during decode gets its hash exactly as a prompt block
would, from its parent's hash and its own tokens, and is cached too (as in vLLM v1): a follow-up
turn whose prompt is the previous prompt, the answer and a new message reuses the answer's blocks.
Invariant: a cached block's hash is the chained hash of exactly the tokens it holds, from the
sequence's first block on, whether it filled in prefill or in decode.

**Extra keys.** The K/V of the same tokens differ when something other than the tokens differs, and
a tenant may want its blocks never shared with another's. vLLM adds a block's *extra keys* to its
hash (``vllm/v1/core/kv_cache_utils.py``: ``generate_block_hash_extra_keys`` and
``hash_block_tokens(hash_fn, parent_hash, tokens, extra_keys)``), and so does the course
(:func:`generate_block_hash_extra_keys`, :func:`block_hash`): a request's LoRA adapter name (the
course serves none: the name is a stand-in with the shape of vLLM's key) enters the hash of *every*
block, its ``cache_salt`` the hash of its *first* block only::

    hash_0 = block_hash(ROOT_HASH, tokens of block 0, (("lora", name), ("cache_salt", salt)))
    hash_i = block_hash(hash_{i-1}, tokens of block i, (("lora", name),))

Since every later hash chains on the first, the salt reaches the whole chain: two requests of
different salts share no block, not even the first, and requests of one salt share as unsalted
requests do among themselves. Invariants: a request without extra keys (no salt, no LoRA name)
hashes exactly as before, ``block_hash(parent, tokens)``; a cached entry keeps its extra keys, and a
hit compares them with the request's as it compares the tokens, so even a hash collision never
gives one salt's block to another; a block filled in decode gets the same keys as a prompt block
of its place (the :class:`HashChain` carries them).

A hash is only a hint: two different prefixes can hash alike. :class:`PrefixCache` therefore keeps,
for each cached block, its token ids and the cached block it follows (its parent), and a hit must
match both: the block's tokens equal the prompt's, and its parent is the very cached block the
previous hit found. By induction the whole prefix matches, so a collision can cost a hit but never
shares a block that holds the wrong data, whatever order blocks are evicted in (a block cached after
a parent that was since evicted, and whose hash a colliding block took over, matches no more).

:class:`PrefixCache` holds the maps and takes no block: the
:class:`~paged_kv.core.block_pool.BlockPool` keeps it beside its free list. A freed block keeps its
hash and its K/V there: it sits on the free list, *cached*, until the pool hands it out for other
data, and only then is its hash dropped (evicted). The head of the free list is the block freed
longest ago, so eviction is least recently used first and O(1). A hit on a cached block that is on
the free list takes it out of the middle of the list, also in O(1); a hit on a block that live
requests hold adds a reference.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

TokenIds = tuple[int, ...]

ExtraKeys = tuple[tuple[str, ...], ...] | None
"""One block's extra keys, as vLLM's ``generate_block_hash_extra_keys`` gives them: tagged tuples,
``("lora", name)`` then ``("cache_salt", salt)``, or ``None`` when the block has none."""

ROOT_HASH = 0
"""The parent hash of a prompt's first block.

An int, not ``None``: Python 3.11 hashes ``None`` by its address, which changes from run to run.
"""


def block_hash(parent_hash: int, token_ids: TokenIds, extra_keys: ExtraKeys = None) -> int:
    """The hash of one full block: its parent's hash (:data:`ROOT_HASH` for the first block), its
    tokens and its ``extra_keys`` (vLLM: ``hash_block_tokens``, which hashes the same triple).

    Without extra keys the hash is ``hash((parent_hash, token_ids))``, as it has always been.
    Python hashes ints and tuples of ints the same way in every process (hash randomisation only
    applies to strings and bytes), so the chain is reproducible run to run; the extra keys, which
    hold strings, enter as a SHA-256 digest of their text, reproducible too. The module calls it
    with two arguments where a block has no extra keys (a test may put a two-argument hash in its
    place).
    """
    if extra_keys is None:
        return hash((parent_hash, token_ids))
    return hash((parent_hash, token_ids, _digest(extra_keys)))


@functools.lru_cache(maxsize=4096)
def _digest(extra_keys: tuple[tuple[str, ...], ...]) -> int:
    """A process-independent int for ``extra_keys`` (a request's few keys are hashed once)."""
    return int.from_bytes(hashlib.sha256(repr(extra_keys).encode()).digest()[:8], "little")


def generate_block_hash_extra_keys(request: object, start_token_idx: int) -> ExtraKeys:
    """The extra keys of ``request``'s block that starts at token ``start_token_idx`` (vLLM's
    ``generate_block_hash_extra_keys``, less its multimodal and prompt-embedding keys, which the
    course has no use for): ``("lora", lora_name)`` for every block of a request with a LoRA name,
    then ``("cache_salt", cache_salt)`` for its first block (``start_token_idx == 0``) when it has
    a salt; ``None`` when there is neither.

    ``request`` is read for ``cache_salt`` and ``lora_name`` only, either absent or ``None`` for a
    request without them (an empty string counts as none, as in vLLM's ``if request.cache_salt``).

    Raises:
        ValueError: ``cache_salt`` or ``lora_name`` is neither a string nor ``None``, named.
    """
    cache_salt = _key_text(request, "cache_salt")
    lora_name = _key_text(request, "lora_name")
    keys = [("lora", lora_name)] if lora_name else []
    if start_token_idx == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def _key_text(request: object, name: str) -> str | None:
    value = getattr(request, name, None)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or None, got {value!r}")
    return value


@dataclass(frozen=True)
class RequestExtraKeys:
    """A request's extra keys for every block of its hash chain: ``first`` for block 0 (the salt and
    the LoRA name), ``rest`` for every later block (the LoRA name): :func:`request_extra_keys`.

    The block a key belongs to is known by its index alone, so a chain that goes on in decode keeps
    this pair and gives each block that fills the keys a prompt block of its place would get.
    """

    first: ExtraKeys = None
    rest: ExtraKeys = None

    def for_block(self, index: int) -> ExtraKeys:
        """The extra keys of logical block ``index``."""
        return self.first if index == 0 else self.rest


NO_EXTRA_KEYS = RequestExtraKeys()
"""The keys of a request with neither salt nor LoRA name: every block hashes as ``block_hash(parent,
tokens)``."""


def request_extra_keys(request: object, block_size: int) -> RequestExtraKeys:
    """``request``'s extra keys for each block of ``block_size`` tokens
    (:func:`generate_block_hash_extra_keys` of block 0 and of block 1, which every later block shares).

    Raises:
        ValueError: ``cache_salt`` or ``lora_name`` is neither a string nor ``None``, named.
    """
    first = generate_block_hash_extra_keys(request, 0)
    rest = generate_block_hash_extra_keys(request, block_size)
    return NO_EXTRA_KEYS if first is None and rest is None else RequestExtraKeys(first, rest)


def full_blocks(token_ids: Sequence[int], block_size: int) -> list[TokenIds]:
    """The token ids of each *full* block, in order; a partly full last block is left out.

    >>> full_blocks([5, 6, 7, 8, 9], 2)
    [(5, 6), (7, 8)]
    """
    starts = range(0, len(token_ids) - block_size + 1, block_size)
    return [tuple(token_ids[start : start + block_size]) for start in starts]


def chain_hashes(blocks: Sequence[TokenIds], extra_keys: RequestExtraKeys = NO_EXTRA_KEYS) -> list[int]:
    """The chained hash of each block: ``hash_i = block_hash(hash_{i-1}, blocks[i], keys of block i)``.

    The first block's parent hash is :data:`ROOT_HASH`; ``extra_keys`` are the request's
    (:func:`request_extra_keys`; by default none, and every hash is ``block_hash(parent, tokens)``).
    """
    hashes: list[int] = []
    parent = ROOT_HASH
    for index, tokens in enumerate(blocks):
        keys = extra_keys.first if index == 0 else extra_keys.rest
        parent = block_hash(parent, tokens) if keys is None else block_hash(parent, tokens, keys)
        hashes.append(parent)
    return hashes


def check_token_ids(
    token_ids: object,
    num_prompt_tokens: int | None,
    count_name: str = "num_prompt_tokens",
    per: str = "prompt token",
) -> TokenIds:
    """``token_ids`` as a tuple of ints, when it holds ``num_prompt_tokens`` non-negative integers.

    A list, tuple or range of ints (numpy integer scalars too) or a 1-D integer tensor is accepted.
    ``count_name`` and ``per`` name the count in the message (``"n"`` and ``"appended token"`` for
    the tokens of an append); a count of ``None`` takes any length.

    Raises:
        ValueError: naming ``token_ids``: not a sequence of integers, a negative or boolean id, or
            a length other than ``num_prompt_tokens``.
    """
    if _is_tensor(token_ids):  # a torch tensor, told by its attributes: core imports no torch
        dtype = token_ids.dtype
        if token_ids.dim() != 1 or dtype.is_floating_point or dtype.is_complex:
            raise ValueError(
                f"token_ids must be a 1-D integer tensor, got shape {tuple(token_ids.shape)} "
                f"and dtype {dtype}"
            )
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
        raise ValueError(f"token_ids must be a list of integers, got {type(token_ids).__name__}")
    if num_prompt_tokens is not None and len(token_ids) != num_prompt_tokens:
        raise ValueError(
            f"token_ids must hold one id per {per}: {count_name} is {num_prompt_tokens}, "
            f"but token_ids has {len(token_ids)}"
        )
    if all(type(token) is int for token in token_ids) and min(token_ids, default=0) >= 0:
        return tuple(token_ids)  # the common case, checked at C speed (a decode step's batch)
    for index, token in enumerate(token_ids):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
            raise ValueError(f"token_ids must be non-negative integers, got {token!r} at index {index}")
    return tuple(int(token) for token in token_ids)


def _is_tensor(value: object) -> bool:
    """Whether ``value`` looks like a torch tensor (``dim``, ``dtype`` and ``tolist``)."""
    return all(hasattr(value, name) for name in ("dim", "dtype", "tolist"))


@dataclass(frozen=True)
class PrefixCacheStats:
    """What the prefix cache found, counted in tokens, as vLLM's ``PrefixCacheStats``
    (``vllm/v1/metrics/stats.py``) counts it.

    A request looked up again after a preemption (it resumes with its prompt and the tokens it had
    generated) counts apart, in the ``preempted_`` fields, as vLLM counts a request whose
    ``num_preemptions > 0``: ``requests``, ``queries`` and ``hits`` are first lookups only, and so is
    :attr:`hit_rate`, the hit rate vLLM logs and exports (``vllm:prefix_cache_queries``,
    ``vllm:prefix_cache_hits``). Every lookup is one or the other: the tokens looked up in all are
    ``queries + preempted_queries``. Only successful allocations with ``token_ids`` count: a refused
    allocation counts nothing. The caller that allocates says whether a lookup is a resumption
    (the engine's memory knows: :class:`~paged_kv.core.kv_cache_manager.KVCacheManager`); the lessons'
    calls never are.
    """

    requests: int = 0
    """Requests looked up for the first time."""
    queries: int = 0
    """Tokens those first lookups looked up."""
    hits: int = 0
    """Tokens of those found in the cache, whose K/V the caller need not compute."""
    preempted_requests: int = 0
    """Requests looked up again after a preemption."""
    preempted_queries: int = 0
    """Tokens those lookups looked up (a resumed request's prompt and generated tokens)."""
    preempted_hits: int = 0
    """Tokens of those found in the cache."""

    @property
    def hit_rate(self) -> float:
        """``hits / queries``, first lookups only (vLLM's), or 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0

    def __add__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        """The counts of both (a run's total from its steps' counts)."""
        if not isinstance(other, PrefixCacheStats):
            return NotImplemented
        return PrefixCacheStats(*(a + b for a, b in zip(_counts(self), _counts(other), strict=True)))

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        """The counts since ``other``, an earlier reading of the same counters."""
        if not isinstance(other, PrefixCacheStats):
            return NotImplemented
        return PrefixCacheStats(*(a - b for a, b in zip(_counts(self), _counts(other), strict=True)))


def _counts(stats: PrefixCacheStats) -> tuple[int, ...]:
    return (
        stats.requests,
        stats.queries,
        stats.hits,
        stats.preempted_requests,
        stats.preempted_queries,
        stats.preempted_hits,
    )


@dataclass(frozen=True, eq=False)
class CachedBlock:
    """One block in the prefix cache: which physical block, its chained hash, tokens and parent,
    the KV-cache group whose layers' K/V it holds (0 but in a hybrid model's pool, lesson 13), and
    the extra keys its hash took (``None`` for a request without salt or LoRA name).

    ``eq=False``: two entries are the same only when they are the same object, so a block that is
    evicted and cached again gets a new identity, and the children cached under its old contents
    no longer match it. An entry keeps its parent alive after the parent is evicted, so the tokens
    of its whole prefix can always be read back through ``parent`` links.
    """

    block_id: int
    block_hash: int
    token_ids: TokenIds
    parent: CachedBlock | None = field(repr=False)
    group: int = 0
    extra_keys: ExtraKeys = None


@dataclass(eq=False)
class HashChain:
    """Where a sequence stands in the chain of block hashes: what its next full block is hashed after.

    ``last`` is the entry its last full block is found under (its own block's, or an equal
    block's), ``None`` before its first full block; ``num_blocks`` counts its full blocks, so the
    block that fills next is logical block ``num_blocks``; ``tail`` holds the token ids already in
    that block (fewer than a block); ``extra_keys`` are the sequence's (its salt and LoRA name),
    which every block that fills takes for its place. A sequence whose tokens the cache does not
    know (allocated or grown without token ids) has no chain.
    """

    last: CachedBlock | None
    num_blocks: int
    tail: list[int] = field(default_factory=list)
    extra_keys: RequestExtraKeys = NO_EXTRA_KEYS

    def copy(self) -> HashChain:
        """The same place in the chain, with a tail of its own (for a fork)."""
        return HashChain(self.last, self.num_blocks, list(self.tail), self.extra_keys)


class PrefixCache:
    """The maps of prefix caching, and its counters: no blocks are taken or freed here.

    Invariants:

    * ``(hash, group) -> entry`` and ``block id -> entry`` hold the same entries: a block holds at
      most one hash, and a hash names at most one block of each KV-cache group (vLLM keys its map
      by ``BlockHashWithGroupId`` alike: the same tokens are different K/V in different layers);
    * every entry's parent is ``None`` (the first block of a sequence) or was cached before it,
      and its hash is ``block_hash(parent's hash, its tokens, its extra keys)``: the chained hash
      of exactly the tokens from its sequence's first block to its own, and of its sequence's salt
      and LoRA name, whether it filled in prefill or decode;
    * a hit matches hash, tokens, extra keys and parent, so it holds the K/V of exactly the
      request's prefix under the request's salt and LoRA name.
    """

    def __init__(self) -> None:
        self._by_hash: dict[tuple[int, int], CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self._stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def stats(self) -> PrefixCacheStats:
        """The counters since the cache was built or reset."""
        return self._stats

    def cached_blocks(self) -> dict[int, TokenIds]:
        """Every cached block id and the token ids it holds (a new dict)."""
        return {block_id: entry.token_ids for block_id, entry in self._by_block.items()}

    def entry(self, block_id: int) -> CachedBlock | None:
        """The cache entry of a block, or ``None`` when the block holds no hash."""
        return self._by_block.get(block_id)

    def match(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        group: int = 0,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> list[CachedBlock]:
        """The longest run of leading blocks found in the cache for ``group``, at most ``max_blocks``.

        Block ``i`` is a hit when an entry of the group has its hash, its tokens, its extra keys
        (``extra_keys``, the request's: :func:`request_extra_keys`) and as parent the entry that
        matched block ``i - 1``; the first miss ends the run (a block is only useful after its
        whole prefix): what a full-attention layer needs.
        """
        hits: list[CachedBlock] = []
        parent = None
        keys = extra_keys.first
        for tokens, block_hash_ in zip(blocks[:max_blocks], hashes, strict=False):
            entry = self._by_hash.get((block_hash_, group))
            if (
                entry is None
                or entry.parent is not parent
                or entry.token_ids != tokens
                or entry.extra_keys != keys
            ):
                break
            hits.append(entry)
            parent = entry
            keys = extra_keys.rest
        return hits

    def match_window(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        need: int,
        group: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[CachedBlock | None], int]:
        """The longest prefix, at most ``max_blocks`` blocks, whose last ``need`` blocks are all
        cached for ``group``: what a sliding-window layer needs (vLLM: ``SlidingWindowManager.
        find_longest_cache_hit``, which searches from the right in the same way).

        A run of ``need`` consecutive cached blocks ending at block ``n - 1`` is a hit of ``n``
        blocks: the blocks before it may be gone, since the window of token ``n * block_size``
        reads only those ``need`` blocks. So is a run of fewer than ``need`` blocks that starts at
        block 0 (the window reaches back to the first token). Each entry of a run must have the
        block's hash, tokens and extra keys (the request's ``extra_keys``) and, as parent, the
        run's entry before it; the run's first entry must descend, through ``parent`` links that
        outlive eviction, from entries holding exactly the tokens and extra keys of every block
        before it (the first block's salt among them): so a hash collision can cost a hit here too,
        but never share a block whose prefix or salt differs.

        Returns:
            The entry of each block of the hit (``None`` for the blocks before the run, which the
            caller does not need), and the hit's length in blocks.
        """
        found: list[CachedBlock | None] = [None] * max_blocks
        run = 0  # the length of the run of linked entries from block i on
        for i in range(max_blocks - 1, -1, -1):
            entry = self._by_hash.get((hashes[i], group))
            if entry is None or entry.token_ids != blocks[i] or entry.extra_keys != extra_keys.for_block(i):
                run = 0
                continue
            if run and found[i + 1].parent is not entry:  # type: ignore[union-attr]
                run = 0  # not the same chain: a new run starts here
            found[i] = entry
            run += 1
            if run >= need and _descends(entry, blocks, i, extra_keys):
                return [None] * i + found[i : i + run], i + run
        if run and not _descends(found[0], blocks, 0, extra_keys):  # type: ignore[arg-type]
            run = 0
        return found[:run], run

    def extend(
        self,
        parent: CachedBlock | None,
        tokens: TokenIds,
        block_id: int,
        block_hash_: int | None = None,
        group: int = 0,
        evicted_parent: bool = False,
        extra_keys: ExtraKeys = None,
    ) -> CachedBlock | None:
        """Cache a full block that follows ``parent`` (``None``: a sequence's first block) in ``block_id``.

        The one rule for every full block after a sequence's hits, whether it filled in prefill or
        in decode. Its hash is ``block_hash(parent's hash, tokens, extra_keys)`` (``block_hash_``,
        when the caller computed it already), ``extra_keys`` being the block's own
        (:meth:`RequestExtraKeys.for_block`). Then:

        * the hash is free: ``block_id`` is cached under it, with ``parent`` as its parent;
        * an equal block holds it (the same tokens and extra keys after the same parent, such as a
          block the hit limit left out, or two sequences that decoded the same tokens):
          ``block_id`` stays private, and the chain goes on through the equal block, whose K/V are
          the same;
        * another block holds it (a collision), or ``parent`` is no longer cached (evicted, or a
          reset): nothing is cached and the chain ends, since no later block could be found after
          this one.

        ``block_id`` must hold no hash (fresh from ``allocate``). ``group`` is the KV-cache group
        whose K/V the block holds. ``evicted_parent=True`` lets the chain go on after its parent
        was evicted: a sliding-window group's earlier blocks leave the pool while its later ones
        are still worth caching, since :meth:`match_window` reads their prefix through the entries'
        ``parent`` links, not through the pool.

        Returns:
            The entry the sequence's next full block follows, or ``None`` when the chain ends.
        """
        if parent is not None and not evicted_parent and self._by_block.get(parent.block_id) is not parent:
            return None
        if block_hash_ is None:
            parent_hash = ROOT_HASH if parent is None else parent.block_hash
            block_hash_ = (
                block_hash(parent_hash, tokens)
                if extra_keys is None
                else block_hash(parent_hash, tokens, extra_keys)
            )
        entry = self._by_hash.get((block_hash_, group))
        if entry is not None:
            same = entry.parent is parent and entry.token_ids == tokens and entry.extra_keys == extra_keys
            return entry if same else None
        entry = CachedBlock(block_id, block_hash_, tokens, parent, group, extra_keys)
        self._by_hash[block_hash_, group] = entry
        self._by_block[block_id] = entry
        return entry

    def evict(self, block_id: int) -> CachedBlock | None:
        """Forget the hash a block holds, if any (its K/V are about to be overwritten).

        Returns:
            The entry the block held, or ``None``.
        """
        entry = self._by_block.pop(block_id, None)
        if entry is not None:
            del self._by_hash[entry.block_hash, entry.group]
        return entry

    def record(self, queries: int, hits: int, preempted: bool = False) -> None:
        """Count one lookup of ``queries`` tokens, ``hits`` of them found in the cache: a first one,
        or with ``preempted`` a resumed request's, apart (vLLM: ``PrefixCacheStats.record``)."""
        stats = self._stats
        if preempted:
            self._stats = replace(
                stats,
                preempted_requests=stats.preempted_requests + 1,
                preempted_queries=stats.preempted_queries + queries,
                preempted_hits=stats.preempted_hits + hits,
            )
        else:
            self._stats = replace(
                stats, requests=stats.requests + 1, queries=stats.queries + queries, hits=stats.hits + hits
            )

    def reset(self) -> int:
        """Forget every hash and zero the counters; return how many blocks were cached."""
        dropped = len(self._by_block)
        self._by_hash.clear()
        self._by_block.clear()
        self._stats = PrefixCacheStats()
        return dropped


def _descends(
    entry: CachedBlock, blocks: Sequence[TokenIds], index: int, extra_keys: RequestExtraKeys
) -> bool:
    """Whether ``entry``, found for block ``index``, follows entries holding exactly ``blocks[:index]``
    under ``extra_keys``, of its own group, through its ``parent`` links (which outlive eviction),
    back to a first block."""
    parent = entry.parent
    for i in range(index - 1, -1, -1):
        if (
            parent is None
            or parent.token_ids != blocks[i]
            or parent.group != entry.group
            or parent.extra_keys != extra_keys.for_block(i)
        ):
            return False
        parent = parent.parent
    return parent is None
