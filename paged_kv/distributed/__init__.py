"""What leaves the engine's process (vLLM: ``vllm/distributed/``): the KV-cache events a router
reads (:mod:`~paged_kv.distributed.kv_events`), lesson 08's prefix cache told to the world (lesson 16's
server publishes them)."""
