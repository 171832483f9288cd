"""A request as the scheduler and the memory it admits into see it (lessons 07, 09, 11)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.validate import check_count, check_hashable


@dataclass(frozen=True)
class SchedulerRequest:
    """A request as the scheduler sees it: ``num_prompt_tokens`` of prompt, ``max_new_tokens`` to generate.

    ``prompt_token_ids`` are the prompt's token ids, or None where nobody needs them (the
    simulator); prefix caching and a model need them. A request finishes after ``max_new_tokens``
    tokens, or as soon as it generates one of ``stop_token_ids`` (a model's end-of-sequence tokens
    and the request's own; none by default), which it keeps. ``sampling_params`` says how the runner
    picks its tokens (lesson 15); None is greedy.
    """

    request_id: Hashable
    num_prompt_tokens: int
    max_new_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    stop_token_ids: frozenset[int] = frozenset()
    sampling_params: SamplingParams | None = None

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        check_count("num_prompt_tokens", self.num_prompt_tokens, minimum=1)
        check_count("max_new_tokens", self.max_new_tokens, minimum=1)
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.num_prompt_tokens:
            raise ValueError(
                f"prompt_token_ids of request {self.request_id!r} must hold num_prompt_tokens "
                f"({self.num_prompt_tokens}) ids, got {len(self.prompt_token_ids)}"
            )
