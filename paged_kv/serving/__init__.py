"""Serving: the one scheduler, the memory it admits into, its runners and the engine (lessons 07, 09, 11).

* :mod:`~paged_kv.serving.scheduler`: :class:`~paged_kv.serving.scheduler.Scheduler`, which decides
  each step (swap-ins, admissions with prefill, preemptions, decodes) as a ``SchedulerOutput`` and
  takes the sampled tokens back with ``update``;
* :mod:`~paged_kv.serving.memory`: the KV memory it admits into, paged (the one admission rule,
  ``admits``) or contiguous reservations;
* :mod:`~paged_kv.serving.preemption`: ``choose_victims``, newest first, never the oldest alone;
* :mod:`~paged_kv.serving.protocols`: the cache the engine drives, as ``typing.Protocol`` classes;
* :mod:`~paged_kv.serving.model_runner`: the runner of the tiny GPT, and one that only counts tokens;
* :mod:`~paged_kv.serving.engine`: ``Engine``, the loop of schedule, execute and update.
"""
