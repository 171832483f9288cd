"""Who picks the block size: the kernel block sizes each attention backend runs, and the one size
vLLM picks for a model whose layers may use several backends (lesson 14).

The block size is the manager's unit: how many tokens one block of the pool holds. vLLM 0.33.0 does
not leave it to the user alone. Each attention backend declares the **kernel block sizes** its kernels
run, ``AttentionBackend.get_supported_kernel_block_sizes`` (``vllm/v1/attention/backend.py``), a list
of exact sizes (``64``) and of :class:`MultipleOf` (``MultipleOf(16)``: any multiple of 16). The list
is read by two rules, and this module has both:

* **Which manager block sizes a backend accepts** (``AttentionBackend.supports_block_size``, the
  base class's rule): a size is accepted when it is a multiple of some entry's base, an exact ``64``
  included, since the worker can split a manager block of 128 into kernel blocks of 64. An empty list
  accepts any size. :func:`supports_block_size`.
* **Which kernel block a manager block is split into** (``select_common_block_size`` in
  ``vllm/v1/worker/utils.py``, through ``_block_size_is_supported``): there an exact entry must
  match exactly, and a ``MultipleOf`` accepts its multiples. :func:`kernel_block_size`.

At start-up, unless the user gave ``--block-size`` (``CacheConfig.user_specified_block_size``,
``vllm/config/cache.py``), ``Platform.update_block_size_for_backend`` (``vllm/platforms/interface.py``)
sets the block size to ``_preferred_block_size_for_backends`` of the model's distinct attention
backends, starting from ``CacheConfig.DEFAULT_BLOCK_SIZE``, 16 (:data:`DEFAULT_BLOCK_SIZE`); the CPU
platform (``vllm/platforms/cpu.py``) starts from 128 instead (:data:`CPU_DEFAULT_BLOCK_SIZE`). One
backend keeps the start if it accepts it, else takes its smallest size
(``AttentionBackend.get_preferred_block_size``: :func:`preferred_block_size`); several keep the
start if all accept it, else take the smallest least common multiple of one size per backend that
all accept (:func:`common_block_size`). Then a hybrid attention/mamba model may raise the size so
that an attention page covers a mamba page (``_align_hybrid_block_size``, not modelled here: Qwen3-Next
gets blocks of 544 tokens that way). At the worker, ``prepare_kernel_block_sizes`` picks each KV-cache
group's kernel block with ``select_common_block_size`` (:func:`kernel_block_size`), unless the layers'
pages are packed block-outermost, where the manager block is the kernel block.

:data:`BACKEND_BLOCK_SIZES` lists vLLM 0.33.0's backends by their ``get_name()`` with their sizes in
the common case. Left out, because they depend on the GPU, the model or the dtype: FlashAttention 4
with an fp8 cache and head size 512 on SM90 (exactly 64), FlashAttention 4's head-size-256 kernel
(exactly 128) and FlashAttention on XPU (``MultipleOf(64)``, preferring 64); FlashInfer's large pages
(128 to 1,024 as well, with grouped-query heads on the SM100 family where trtllm-gen runs); ROCm's
AITER FlashAttention, which is also named ``"FLASH_ATTN"`` and runs 16 and 32. A backend given by
name follows its own ``supports_block_size``: CPU_MLA overrides it to accept exactly 16 and no
multiple (:data:`EXACT_SIZES_ONLY`); a backend given by its list follows the base class's rule.

Everywhere a backend is expected, give its name (a key of :data:`BACKEND_BLOCK_SIZES`) or its list of
sizes (ints of at least 1 and :class:`MultipleOf`). Bad input is a ``ValueError`` naming the argument.

Invariants: :func:`common_block_size` returns a size every backend accepts; it is the default when
every backend accepts the default (or there is one backend that does), and otherwise no smaller least
common multiple of one size per backend is accepted by all. :func:`kernel_block_size` returns a size
that divides the manager block and that the backend's kernel rule accepts: the manager block itself
when accepted, else the largest exact entry dividing it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from paged_kv.validate import check_count


@dataclass(frozen=True)
class MultipleOf:
    """Any multiple of ``base`` tokens (vLLM's ``MultipleOf``): ``MultipleOf(16)`` accepts 16, 32, 48, ..."""

    base: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "base", check_count("base", self.base, minimum=1))

    def __repr__(self) -> str:
        return f"MultipleOf({self.base})"


SupportedSize = int | MultipleOf
"""One entry of a backend's list: an exact size, or :class:`MultipleOf` a base."""
Backend = str | Sequence[SupportedSize]
"""A backend: its vLLM name (a key of :data:`BACKEND_BLOCK_SIZES`), or its list of sizes."""

DEFAULT_BLOCK_SIZE = 16
"""The block size vLLM starts from (``CacheConfig.DEFAULT_BLOCK_SIZE``)."""
CPU_DEFAULT_BLOCK_SIZE = 128
"""The block size vLLM's CPU platform starts from instead (``CpuPlatform.update_block_size_for_backend``)."""

BACKEND_BLOCK_SIZES: dict[str, tuple[SupportedSize, ...]] = {
    "FLASH_ATTN": (MultipleOf(16),),  # v1/attention/backends/flash_attn.py:367
    "FLASHINFER": (16, 32, 64),  # flashinfer.py:603
    "TRITON_ATTN": (MultipleOf(16),),  # triton_attn.py:340
    "FLEX_ATTENTION": (MultipleOf(16),),  # flex_attention.py:154
    "CPU_ATTN": (MultipleOf(32),),  # cpu_attn.py:66
    "ROCM_ATTN": (MultipleOf(16),),  # rocm_attn.py:165
    "FLASH_ATTN_MLA": (MultipleOf(16),),  # mla/flashattn_mla.py:50
    "TRITON_MLA": (MultipleOf(16),),  # mla/triton_mla.py:115
    "FLASHMLA": (64,),  # mla/flashmla.py:58
    "FLASHINFER_MLA": (32, 64),  # mla/flashinfer_mla.py:205
    "CUTLASS_MLA": (128,),  # mla/cutlass_mla.py:50
    "CPU_MLA": (16,),  # mla/cpu_mla.py:68
}
"""vLLM 0.33.0's attention backends, by ``get_name()``, and their ``get_supported_kernel_block_sizes()``
in the common case (the exceptions are in the module's docstring); the comments give each list's line."""

EXACT_SIZES_ONLY = frozenset({"CPU_MLA"})
"""The backends of :data:`BACKEND_BLOCK_SIZES` whose ``supports_block_size`` accepts their exact sizes
only, no multiple of them (``CPUMLABackend.supports_block_size``: ``block_size == 16``)."""


def _resolve(name: str, backend: object) -> tuple[tuple[SupportedSize, ...], bool]:
    """A backend's sizes, checked, and whether only its exact sizes are accepted as the manager's."""
    if isinstance(backend, str):
        if backend not in BACKEND_BLOCK_SIZES:
            raise ValueError(
                f"{name}: no backend named {backend!r}; the backends are {', '.join(BACKEND_BLOCK_SIZES)}"
            )
        return BACKEND_BLOCK_SIZES[backend], backend in EXACT_SIZES_ONLY
    if not isinstance(backend, Sequence):
        raise ValueError(
            f"{name} must be a backend's name or its list of sizes, got {type(backend).__name__} {backend!r}"
        )
    sizes: list[SupportedSize] = []
    for index, size in enumerate(backend):
        if isinstance(size, MultipleOf):
            sizes.append(size)
        else:
            try:
                sizes.append(check_count(f"{name}[{index}]", size, minimum=1))
            except ValueError as error:
                raise ValueError(f"{error} (a size is an int or a MultipleOf)") from None
    return tuple(sizes), False


def _base(size: SupportedSize) -> int:
    return size.base if isinstance(size, MultipleOf) else size


def _accepts(sizes: tuple[SupportedSize, ...], exact: bool, block_size: int) -> bool:
    """The manager's rule: no sizes accept any; else a multiple of some base (exact ones: equal)."""
    if not sizes:
        return True
    if exact:
        return block_size in sizes
    return any(block_size % _base(size) == 0 for size in sizes)


def _label(backend: Backend, index: int) -> str:
    return backend if isinstance(backend, str) else f"backend {index}"


def supports_block_size(supported: Backend, block_size: int) -> bool:
    """Whether a backend accepts ``block_size`` as the manager's block size (vLLM:
    ``AttentionBackend.supports_block_size``): a multiple of some entry's base; any size when the list
    is empty; for CPU_MLA, given by name, exactly 16.

    >>> supports_block_size([MultipleOf(16)], 48), supports_block_size([64], 128)
    (True, True)
    >>> supports_block_size([64], 32), supports_block_size([], 7), supports_block_size("CPU_MLA", 32)
    (False, True, False)
    """
    sizes, exact = _resolve("supported", supported)
    return _accepts(sizes, exact, check_count("block_size", block_size, minimum=1))


def preferred_block_size(supported: Backend, default_block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The block size one backend picks (vLLM: ``AttentionBackend.get_preferred_block_size``): the
    default when it accepts it (or its list is empty), else its smallest size's base.

    >>> preferred_block_size("FLASH_ATTN"), preferred_block_size("FLASHMLA")
    (16, 64)
    >>> preferred_block_size("CPU_ATTN", CPU_DEFAULT_BLOCK_SIZE), preferred_block_size("CPU_ATTN")
    (128, 32)
    """
    sizes, exact = _resolve("supported", supported)
    default = check_count("default_block_size", default_block_size, minimum=1)
    if _accepts(sizes, exact, default):
        return default
    return min(_base(size) for size in sizes)


def common_block_size(backends: Sequence[Backend], default_block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The block size vLLM picks for a model whose attention layers use ``backends`` (vLLM:
    ``Platform._preferred_block_size_for_backends``).

    One backend: its :func:`preferred_block_size`. Several: the default when every backend accepts
    it; else the smallest of the least common multiples of one size per backend (a backend without
    sizes contributes 1) that every backend accepts. No backend at all: the default.

    >>> common_block_size(["FLASHINFER", "FLASHMLA"]), common_block_size([[24], [MultipleOf(16)]])
    (64, 48)

    Raises:
        ValueError: a bad argument, or no candidate that every backend accepts (possible only with a
            backend that accepts its exact sizes only, CPU_MLA); the message gives each backend's sizes.
    """
    if isinstance(backends, str) or not isinstance(backends, Sequence):
        raise ValueError(
            f"backends must be a list of backends (each a name or a list of sizes), got "
            f"{type(backends).__name__} {backends!r}"
        )
    default = check_count("default_block_size", default_block_size, minimum=1)
    resolved = [_resolve(f"backends[{i}]", backend) for i, backend in enumerate(backends)]
    if len(resolved) == 1:
        return preferred_block_size(backends[0], default)
    if all(_accepts(sizes, exact, default) for sizes, exact in resolved):
        return default
    choices = [[_base(size) for size in sizes] or [1] for sizes, _ in resolved]
    for candidate in sorted({math.lcm(*choice) for choice in itertools.product(*choices)}):
        if all(_accepts(sizes, exact, candidate) for sizes, exact in resolved):
            return candidate
    described = "; ".join(
        f"{_label(backend, i)}: {list(sizes)}"
        for i, (backend, (sizes, _)) in enumerate(zip(backends, resolved, strict=True))
    )
    raise ValueError(f"backends: the attention backends share no supported block size ({described})")


def kernel_block_size(manager_block_size: int, supported: Backend) -> int:
    """The kernel block a KV-cache group's manager block is split into, for one backend (vLLM:
    ``select_common_block_size``): the manager block itself when the kernels accept it (an exact entry
    equal to it, or a ``MultipleOf`` whose base divides it), else the largest exact entry that divides it.

    A hybrid model's 544-token blocks stay whole on FlashAttention (``MultipleOf(16)``) and are split
    into 17 kernel blocks of 32 on FlashInfer (16, 32, 64: 544 is no multiple of 64):

    >>> kernel_block_size(544, "FLASH_ATTN"), kernel_block_size(544, "FLASHINFER")
    (544, 32)

    Raises:
        ValueError: a bad argument, or no kernel block fits (no entry divides the manager block; an
            empty list has no kernel block here, as in vLLM's ``_block_size_is_supported``).
    """
    sizes, _ = _resolve("supported", supported)
    manager = check_count("manager_block_size", manager_block_size, minimum=1)
    for size in sizes:
        if size == manager or (isinstance(size, MultipleOf) and manager % size.base == 0):
            return manager
    divisors = [size for size in sizes if isinstance(size, int) and manager % size == 0]
    if divisors:
        return max(divisors)
    raise ValueError(
        f"manager_block_size: no kernel block of {list(sizes)} divides a block of {manager} tokens"
    )
