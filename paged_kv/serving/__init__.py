"""Serving: the one scheduler, the memory it takes blocks from, its runners, the engine (lessons 07, 09-11).

* :mod:`~paged_kv.serving.scheduler`: :class:`~paged_kv.serving.scheduler.Scheduler`, vLLM v1's:
  each step's tokens per request and their blocks, preemptions, admissions, as a
  ``SchedulerOutput``; the sampled tokens come back with ``update_from_output``;
* :mod:`~paged_kv.serving.outputs`: the step's two values, ``SchedulerOutput`` and ``ModelRunnerOutput``;
* :mod:`~paged_kv.serving.memory`: the KV memory it takes blocks from, paged (``KVCacheManager``)
  or contiguous reservations;
* :mod:`~paged_kv.serving.protocols`: what the engine drives (the memory, the runner), as
  ``typing.Protocol`` classes;
* :mod:`~paged_kv.serving.model_runner`: the runner of a model, and one that only counts tokens;
* :mod:`~paged_kv.serving.config`: the engine's settings, vLLM's ``CacheConfig`` and ``SchedulerConfig``;
* :mod:`~paged_kv.serving.engine`: ``Engine``, the loop of schedule, execute and update;
* :mod:`~paged_kv.serving.metrics`: what a run measured, by vLLM's metric names (lesson 14);
* :mod:`~paged_kv.serving.workloads`: multi-turn chat with the model's own answers (lesson 14).
"""
