"""An OpenAI-compatible server over :class:`~paged_kv.serving.async_llm.AsyncLLM` (lesson 16; vLLM:
``vllm/entrypoints/openai/``).

``paged-kv serve`` (or ``make serve``) runs it from a terminal; in Python::

    app = build_app(async_llm, model_name="tiny", encode=encode, decode=decode)
    with ServerThread(app) as server:  # uvicorn in a thread, on a free port of 127.0.0.1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed")

One module a concept, as vLLM splits them:

* :mod:`~paged_kv.entrypoints.openai.protocol`: the requests, responses, stream chunks and errors;
* :mod:`~paged_kv.entrypoints.openai.serving`: what both endpoints check before the engine sees a
  request, and the error format;
* :mod:`~paged_kv.entrypoints.openai.serving_completion` and
  :mod:`~paged_kv.entrypoints.openai.serving_chat`: ``/v1/completions`` and ``/v1/chat/completions``,
  whole or streamed as server-sent events;
* :mod:`~paged_kv.entrypoints.openai.serving_tokenization`: ``/tokenize`` and ``/detokenize``;
* :mod:`~paged_kv.entrypoints.openai.fields`: what the server does with every request field
  (served, a no-op, or refused by name), the table ``docs/server_fields.md`` is made from;
* :mod:`~paged_kv.entrypoints.openai.metrics`: ``/metrics``, vLLM's Prometheus metrics;
* :mod:`~paged_kv.entrypoints.openai.api_server`: :func:`build_app`, the routes and the error handlers;
* :mod:`~paged_kv.entrypoints.openai.launcher`: uvicorn, in the foreground or in a
  :class:`ServerThread`.

Importing this package imports nothing: FastAPI and uvicorn load with the modules that use them.
"""
