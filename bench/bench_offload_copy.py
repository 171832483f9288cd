"""The host tier's copies against a plain copy of the same bytes (issue 33, item 6's second half).

A store (:meth:`~paged_kv.kv_offload.cpu.gpu_worker.CPUOffloadingWorker.submit_store`) moves
``num_blocks`` blocks, scattered over the device pool, into scattered host blocks, every layer's K
and V; a load moves them back. Each is one batched call per tensor (a gather, one move, a scatter),
never one per block. The baseline, the limit, is one ``copy_`` of a contiguous tensor of the same
bytes between the same two memories: device to host and back, into pinned memory on CUDA (the
bus's bandwidth), RAM to RAM on the CPU (one ``memcpy``). Both are timed in turn, round by round
(``paged_kv.timing.compare_times``, the device synchronized in each sample), and reported in GB/s;
the ratio is the tier's share of the limit. On the CPU the tier reads and writes the bytes twice
(gather, then scatter), so half the limit is what it can reach; on CUDA the gather and the scatter
run on either side of the one move over the bus.

The blocks are Llama-3-8B's layer shape (8 K/V heads of 128, bfloat16, 16 tokens: 64 KiB of K and V
per layer) over fewer layers, so that a transfer's bytes fit a laptop.

    .venv/bin/python bench/bench_offload_copy.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, spread_of, text_table

from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.base import GPULoadStoreSpec
from paged_kv.kv_offload.cpu.common import CPULoadStoreSpec
from paged_kv.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from paged_kv.timing import compare_times

#: The tier's share of the limit to reach: a store and a load each pass the bytes through memory
#: twice more than one copy does (gather and scatter), which costs at most a factor of about 3.
TARGET_SHARE = 0.3


def run(
    num_layers: int = 8,
    num_blocks: int = 128,
    block_size: int = 16,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    repeats: int = 9,
    device: str | None = None,
    threads: int = 1,
) -> list[Row]:
    """Time a store and a load of ``num_blocks`` scattered blocks against plain copies of their bytes,
    on ``device`` (CUDA when there is one, else the CPU), with ``threads`` torch threads (1 by
    default, as the other benches: on a shared, busy machine a second thread stalls at random)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rng = random.Random(0)
    storage = KVStorage(
        num_layers, 4 * num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device
    )
    worker = CPUOffloadingWorker(storage, 2 * num_blocks)
    device_ids = GPULoadStoreSpec(rng.sample(range(storage.num_blocks), num_blocks))
    host_ids = CPULoadStoreSpec(rng.sample(range(worker.num_cpu_blocks), num_blocks))
    num_bytes = num_blocks * storage.bytes_per_block
    on_device = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def store() -> None:
        worker.submit_store(0, device_ids, host_ids)
        worker.get_finished()

    def load() -> None:
        worker.submit_load(1, host_ids, device_ids)
        worker.get_finished()

    timings = compare_times(
        {
            "store": store,
            "plain store": lambda: on_host.copy_(on_device),
            "load": load,
            "plain load": lambda: on_device.copy_(on_host),
        },
        repeats=repeats,
        device=device,
        threads=threads,
    )
    where = "device to pinned host" if device.type == "cuda" else "RAM to RAM"
    block_kib = storage.bytes_per_block / 1024
    shape = f"{num_blocks} blocks of {block_kib:g} KiB ({num_layers} layers, {device.type}, {threads} thread)"
    rows = []
    for name, direction in (("store", where), ("load", "back")):
        pairs = zip(timings.samples[f"plain {name}"], timings.samples[name], strict=True)
        share, spread = spread_of(plain / tier for plain, tier in pairs)
        rows.append(
            Row(
                f"host tier {name}, {shape}, vs one copy_ of its bytes ({direction}): share of the limit",
                num_bytes / timings.median(name) / 1e9,
                num_bytes / timings.median(f"plain {name}") / 1e9,
                share,
                f">= {TARGET_SHARE}x",
                share >= TARGET_SHARE,
                unit="GB/s",
                spread=spread,
            )
        )
    return rows


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_layers": 2, "num_blocks": 4, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, "repeats": 2}


if __name__ == "__main__":
    print(text_table(run()))
