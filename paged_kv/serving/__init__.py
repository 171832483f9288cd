"""Serving: vLLM v1's engine in one process, from its settings to its step (lessons 07, 09-11, 13-15).

The request's way, module by module:

* :mod:`~paged_kv.serving.engine_args` and :mod:`~paged_kv.serving.config`: the settings, checked once
  (``EngineArgs``) into one ``VllmConfig`` of vLLM's sections;
* :mod:`~paged_kv.serving.input_processor`: the one check of a request, into an ``EngineCoreRequest``
  (:mod:`~paged_kv.serving.request`, beside the scheduler's ``Request``);
* :mod:`~paged_kv.serving.llm_engine` and :mod:`~paged_kv.serving.async_llm`: the online engine and
  its asyncio front; :mod:`~paged_kv.serving.engine`, the offline ``Engine`` on top (vLLM's ``LLM``),
  and :mod:`~paged_kv.serving.engine_result`, what a run saw;
* :mod:`~paged_kv.serving.engine_core`: the scheduler, memory, storage and runner, built from the
  config and the cache's plan (:mod:`~paged_kv.serving.kv_cache_planning`);
* :mod:`~paged_kv.serving.scheduler`: vLLM v1's scheduler, each step as a ``SchedulerOutput``
  (:mod:`~paged_kv.serving.outputs`), over a memory (:mod:`~paged_kv.serving.protocols`): the paged
  ``KVCacheManager`` for every model (:mod:`~paged_kv.core.kv_cache_manager`) or the contiguous
  baseline (:mod:`~paged_kv.serving.contiguous_memory`);
* :mod:`~paged_kv.serving.model_runner`: the runner of a model, and one that only counts tokens;
  :mod:`~paged_kv.serving.sampler` and :mod:`~paged_kv.serving.sampling_params`, how it samples;
* :mod:`~paged_kv.serving.output_processor`: tokens back to text, stop strings, ``n`` children;
* :mod:`~paged_kv.serving.metrics`: what a run measured, by vLLM's metric names (lesson 15);
  :mod:`~paged_kv.serving.workloads`, multi-turn chat with the model's own answers.
"""
