"""The host tier's worker: host tensors in the device storage's layout, and batched block copies (lesson 11).

vLLM 0.33.0's ``CPUOffloadingWorker`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``) allocates, per KV
cache tensor, a host tensor of ``num_cpu_chunks`` pages (pinned, on CUDA) and copies a transfer's
blocks with one batched call (``swap_blocks_batch``: one descriptor per block and layer, run by
``cuMemcpyBatchAsync`` or a Triton kernel) on a CUDA stream of its own. This worker does the same
with torch's indexing, one call per tensor per transfer and never one per block:

* a **store** gathers the blocks from every layer's K and V on the device (``index_select``), moves
  the gathered bytes to the host in one copy (into pinned memory, on CUDA), and scatters them into
  the host blocks with one ``index_copy_`` over all layers;
* a **load** gathers the host blocks with one ``index_select`` (into pinned memory, on CUDA), moves
  them to the device in one copy and scatters them into every layer's K and V (``index_copy_``).

The copies work on the tensors' bytes, each block one row of words (8 bytes wide where its size
allows), so any dtype the storage holds, fp8 included, comes back bit for bit, and torch's CPU
``index_copy_``, which moves one element at a time, moves 8 bytes at once. A transfer completes before
``submit_store`` / ``submit_load`` returns (vLLM's run asynchronously on their own stream;
:meth:`~CPUOffloadingWorker.get_finished` reports them in the same shape).

Invariant: ``k_caches[layer][b]`` and ``v_caches[layer][b]`` hold host block ``b`` of ``layer`` with
the shape and dtype of one block of the storage's ``k_caches[layer]``; layers that share a device
tensor (``layer_tensors``) share a host tensor too.
"""

from __future__ import annotations

import time

import torch

from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult
from paged_kv.kv_offload.cpu.common import CPULoadStoreSpec
from paged_kv.validate import check_count


class CPUOffloadingWorker(OffloadingWorker):
    """``num_cpu_blocks`` host blocks for ``storage``'s K/V, and the copies between the two.

    The host memory is pinned when the storage is on CUDA, so that the copies run at the bus's speed.

    Raises:
        ValueError: ``storage`` is not a :class:`~paged_kv.kv.storage.KVStorage`,
            ``num_cpu_blocks`` is not a positive integer, or the host memory cannot be allocated.
    """

    def __init__(self, storage: KVStorage, num_cpu_blocks: int) -> None:
        if not isinstance(storage, KVStorage):
            raise ValueError(f"storage must be a KVStorage, got {type(storage).__name__}")
        self.storage = storage
        self.num_cpu_blocks = check_count("num_cpu_blocks", num_cpu_blocks, minimum=1)
        self.pin_memory = storage.device.type == "cuda"
        first_layer = [storage.layer_tensors.index(t) for t in range(storage.num_tensors)]
        block = tuple(storage.k_caches[0].shape[1:])
        try:
            kv = torch.zeros(
                (2, storage.num_tensors, self.num_cpu_blocks, *block),
                dtype=storage.dtype,
                pin_memory=self.pin_memory,
            )
        except (RuntimeError, MemoryError) as error:
            raise ValueError(f"cannot allocate {self.num_cpu_blocks} host blocks: {error}") from None
        #: Host K and V per layer, ``(num_cpu_blocks, num_kv_heads, block_size, head_dim)`` each.
        self.k_caches: tuple[torch.Tensor, ...] = tuple(kv[0, t] for t in storage.layer_tensors)
        self.v_caches: tuple[torch.Tensor, ...] = tuple(kv[1, t] for t in storage.layer_tensors)
        # The bytes the copies move: the host's as one (2 * tensors, blocks, ...) tensor, the
        # device's as each tensor's K, then each one's V, in the same order.
        self._host_words = _words(kv).flatten(0, 1)
        self._device_words = [
            _words(caches[layer]) for caches in (storage.k_caches, storage.v_caches) for layer in first_layer
        ]
        self._finished: list[TransferResult] = []
        self._buffers: dict[torch.device, torch.Tensor] = {}  # staging, by device: see _staging

    def __repr__(self) -> str:
        pinned = ", pinned" if self.pin_memory else ""
        return f"CPUOffloadingWorker(num_cpu_blocks={self.num_cpu_blocks}{pinned}, {self.storage!r})"

    @property
    def nbytes(self) -> int:
        """The host memory the tier's blocks take."""
        return self._host_words.nbytes

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: CPULoadStoreSpec) -> bool:
        """Copy device blocks ``src_spec.block_ids[i]`` to host blocks ``dst_spec.block_ids[i]``,
        every layer's K and V; True (vLLM's "submitted").

        Raises:
            ValueError: a spec of the wrong kind, specs of different lengths, an id out of range or
                a host block named twice; nothing is copied.
        """
        device_index, host_index = self._indices(job_id, src_spec, dst_spec, store=True)
        start = time.perf_counter()
        if len(host_index):
            gathered = self._staging(self.storage.device, len(host_index))
            for tensor, blocks in zip(self._device_words, gathered, strict=True):
                torch.index_select(tensor, 0, device_index, out=blocks)
            if self.pin_memory:
                gathered = self._staging(_CPU, len(host_index)).copy_(gathered)
            self._host_words.index_copy_(1, host_index, gathered)
        return self._done(job_id, len(host_index), start)

    def submit_load(self, job_id: int, src_spec: CPULoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy host blocks ``src_spec.block_ids[i]`` to device blocks ``dst_spec.block_ids[i]``,
        every layer's K and V; True. A ``ValueError`` as for :meth:`submit_store` (a device block
        named twice)."""
        device_index, host_index = self._indices(job_id, dst_spec, src_spec, store=False)
        start = time.perf_counter()
        if len(host_index):
            staged = self._staging(_CPU, len(host_index))
            torch.index_select(self._host_words, 1, host_index, out=staged)
            if self.pin_memory:
                staged = self._staging(self.storage.device, len(host_index)).copy_(staged, non_blocking=True)
            for tensor, blocks in zip(self._device_words, staged, strict=True):
                tensor.index_copy_(0, device_index, blocks)
        return self._done(job_id, len(host_index), start)

    def get_finished(self) -> list[TransferResult]:
        """The transfers submitted since the last call, in order, with their bytes and seconds."""
        finished, self._finished = self._finished, []
        return finished

    def _indices(
        self, job_id: int, device_spec: LoadStoreSpec, host_spec: LoadStoreSpec, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked block ids of a transfer as index tensors: the device's on its device, the
        host's on the CPU."""
        check_count("job_id", job_id)
        device_name, host_name = ("src_spec", "dst_spec") if store else ("dst_spec", "src_spec")
        for name, spec, kind in (
            (device_name, device_spec, GPULoadStoreSpec),
            (host_name, host_spec, CPULoadStoreSpec),
        ):
            if not isinstance(spec, kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {type(spec).__name__}")
        if len(device_spec) != len(host_spec):
            raise ValueError(
                f"src_spec names {len(device_spec if store else host_spec)} blocks but dst_spec "
                f"{len(host_spec if store else device_spec)}: one destination per source block"
            )
        for name, spec, limit in (
            (device_name, device_spec, self.storage.num_blocks),
            (host_name, host_spec, self.num_cpu_blocks),
        ):
            if any(block_id >= limit for block_id in spec.block_ids):
                raise ValueError(f"{name} names block {max(spec.block_ids)}, past the {limit} blocks there")
        dst_name, dst = (host_name, host_spec) if store else (device_name, device_spec)
        if len(set(dst.block_ids)) != len(dst.block_ids):
            raise ValueError(f"{dst_name} names a block twice: two sources cannot copy into one block")
        device_index = torch.tensor(device_spec.block_ids, dtype=torch.long, device=self.storage.device)
        return device_index, torch.tensor(host_spec.block_ids, dtype=torch.long)

    def _staging(self, device: torch.device, num_blocks: int) -> torch.Tensor:
        """A ``(2 * tensors, num_blocks, words)`` tensor on ``device`` (pinned, the host's beside a
        CUDA device) to gather a transfer's blocks into: a view of a buffer kept from one transfer to
        the next and grown to the largest, so that the memory is not allocated and faulted in again
        every step (vLLM pools its transfers' buffers likewise)."""
        rows, words = self._host_words.shape[0], self._host_words.shape[2]
        numel = rows * num_blocks * words
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < numel:
            pin_memory = self.pin_memory and device == _CPU
            buffer = torch.empty(numel, dtype=self._host_words.dtype, device=device, pin_memory=pin_memory)
            self._buffers[device] = buffer
        return buffer[:numel].view(rows, num_blocks, words)

    def _done(self, job_id: int, num_blocks: int, start: float) -> bool:
        """Finish a transfer of ``num_blocks`` blocks started at ``start``: wait for the device,
        then queue its :class:`~paged_kv.kv_offload.base.TransferResult`."""
        if self.pin_memory and num_blocks:
            torch.cuda.current_stream(self.storage.device).synchronize()
        size = num_blocks * self.storage.bytes_per_block
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - start))
        return True


_CPU = torch.device("cpu")


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s blocks, its last three dimensions, each as one row of words: a view of the
    widest integer dtype (up to 8 bytes) whose size divides a block's bytes."""
    rows = tensor.view(torch.uint8).flatten(-3)
    word = next(
        w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if rows.shape[-1] % w.itemsize == 0
    )
    return rows.view(word)
