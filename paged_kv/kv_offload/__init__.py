"""The CPU offload tier (vLLM's native KV offloading, ``--kv-offloading-size``, which lesson 11
names), as vLLM 0.33.0 lays out ``vllm/v1/kv_offload/``:

* :mod:`~paged_kv.kv_offload.base`: the two halves' interfaces and what passes between them
  (``OffloadingManager``, ``OffloadingWorker``, the load/store specs, events, transfer results);
* :mod:`~paged_kv.kv_offload.cpu.manager`: the scheduler's half, an LRU of block hashes over the
  host blocks, no tensors;
* :mod:`~paged_kv.kv_offload.cpu.gpu_worker`: the worker's half, host tensors in the device
  storage's layout (pinned on CUDA) and the batched copies both ways;
* :mod:`~paged_kv.kv_offload.cpu.spec`: ``kv_offloading_size`` GiB to host blocks, and both halves;
* :mod:`~paged_kv.kv_offload.matching`: the tokens the tier adds to the device's prefix hit (the
  connector's ``get_num_new_matched_tokens``).
"""
