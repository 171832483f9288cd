"""A request as the engine core receives it, and as its scheduler keeps it (lessons 07, 09, 11, 15).

Two objects, as in vLLM 0.33.0:

* :class:`EngineCoreRequest` (vLLM: ``EngineCoreRequest`` in ``vllm/v1/engine/__init__.py``): what
  the input processor made of a client's request, frozen: its id, prompt, the most tokens it may
  generate (``max_tokens``, already capped to ``max_model_len``), the tokens that end it, and how
  its tokens are sampled. Checked once, by the input processor
  (:class:`~paged_kv.serving.input_processor.InputProcessor`); lesson 07's simulator builds them by
  hand, with no token ids.
* :class:`Request` (vLLM: ``Request`` in ``vllm/v1/request.py``): the scheduler's live view of one,
  which grows as tokens are sampled and counts what the memory holds for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.validate import check_count, check_hashable


@dataclass(frozen=True)
class EngineCoreRequest:
    """A request as the engine core receives it: ``num_prompt_tokens`` of prompt, up to ``max_tokens``
        to generate.

        ``prompt_token_ids`` are the prompt's token ids, or ``None`` where nobody needs them (the
        simulator); prefix caching and a model need them. A request finishes after ``max_tokens``
        tokens, or as soon as it generates one of ``stop_token_ids`` (a model's end-of-sequence tokens
        and the request's own; none by default), which it keeps. ``sampling_params`` says how the runner
        picks its tokens (lesson 16); ``None`` is greedy. ``arrival_time`` is when it arrived, in the
        engine's clock's seconds (``None``: not measured). ``priority`` orders it under the scheduler's
    ``"priority"`` policy (lower first, vLLM's rule; 0 by default). ``cache_salt`` (vLLM's extra body
    field) and ``lora_name`` enter its blocks' hashes as vLLM's extra keys do
    (``generate_block_hash_extra_keys``): the salt the first block's, so that requests of two salts never
    share a cached block; the LoRA name every block's (the course serves no adapter: the name is the
    stand-in that shows the other extra keys' shape).

        Raises:
            ValueError: an id that cannot be a dict key, counts below 1, or prompt ids that are not
                ``num_prompt_tokens`` long, named.
    """

    request_id: Hashable
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    stop_token_ids: frozenset[int] = frozenset()
    sampling_params: SamplingParams | None = None
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        check_count("num_prompt_tokens", self.num_prompt_tokens, minimum=1)
        check_count("max_tokens", self.max_tokens, minimum=1)
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.num_prompt_tokens:
            raise ValueError(
                f"prompt_token_ids of request {self.request_id!r} must hold num_prompt_tokens "
                f"({self.num_prompt_tokens}) ids, got {len(self.prompt_token_ids)}"
            )


class Request:
    """A request the scheduler holds (vLLM: ``Request``), compared by identity.

    Invariant: ``num_computed_tokens <= num_tokens``; between steps, a request that decodes has
    ``num_computed_tokens == num_tokens - 1`` (its last sampled token is the next step's input).
    """

    __slots__ = (
        "all_token_ids",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prefill_tokens",
        "num_tokens",
        "output_token_ids",
        "priority_key",
        "request",
        "request_id",
        "stop_token_ids",
    )

    def __init__(self, request: EngineCoreRequest, order: int = 0) -> None:
        self.request = request
        arrival = 0.0 if request.arrival_time is None else request.arrival_time
        self.priority_key = (request.priority, arrival, order)
        """Its rank under the ``"priority"`` policy, lower first: ``(priority, arrival_time, order)``,
        ``order`` the scheduler's count of requests added before it, a request with no arrival time
        counted as arrived at 0.0 (vLLM: ``Request.__lt__``, whose last key is the request id)."""
        self.request_id: Hashable = request.request_id
        self.max_tokens, self.stop_token_ids = request.max_tokens, request.stop_token_ids
        params = request.sampling_params
        self.min_tokens = 0 if params is None else params.min_tokens
        """A stop token ends the request only once it has this many output tokens (vLLM's ``check_stop``)."""
        prompt = request.prompt_token_ids
        self.all_token_ids: list[int] | None = None if prompt is None else list(prompt)
        """Prompt then output token ids (``None`` when the prompt's are unknown, as in a simulator)."""
        self.output_token_ids: list[int] = []
        self.num_tokens = request.num_prompt_tokens
        """Prompt and output tokens (vLLM: ``Request.num_tokens``)."""
        self.num_computed_tokens = 0
        """Tokens whose K/V the memory holds (vLLM: ``Request.num_computed_tokens``), cached ones included."""
        self.num_cached_tokens = 0
        """The tokens the prefix cache served at its last admission."""
        self.num_prefill_tokens = 0
        """Its tokens at its last admission: positions below this are prefilled, the others decoded."""
        self.num_preemptions = 0
        """Times it was preempted (vLLM: ``Request.num_preemptions``): its prefix-cache lookups after
        the first count apart."""

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        return None if self.all_token_ids is None else tuple(self.all_token_ids)
