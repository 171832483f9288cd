"""Moving K/V beyond the device pool (vLLM's ``vllm/distributed/kv_transfer/``; lesson 11): the KV
connector's interface and the offloading connector over the host tier."""
