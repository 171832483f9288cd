"""From sampled tokens to what a client reads: text, stop strings, finish reasons, ``n`` children (lesson 16).

vLLM splits its engine in two: the engine core schedules and runs steps on token ids, and the
front end's ``OutputProcessor`` (``vllm/v1/engine/output_processor.py``) turns each step's new
tokens into :class:`RequestOutput` objects. This module is that front end's half:

* it **detokenizes** each completion as its tokens come (the whole output decoded again each step:
  simple, and right for any tokenizer), holding back a trailing ``\\ufffd`` (a character whose bytes
  have not all arrived) and, while stop strings are set, the last ``stop_buffer_length``
  characters, so a client never reads half a stop string;
* it checks the **stop strings**: the first one found ends the completion, its text cut just before
  it (vLLM's default; the tokens stay), and the engine is told to finish the request in the core,
  which frees its blocks at once;
* it names the **finish reason** as vLLM does: ``"stop"`` (an end-of-sequence token, one of the
  request's ``stop_token_ids``, which is its ``stop_reason``, or a stop string, likewise, which
  wins over the others when the same token brings it), ``"length"`` (``max_tokens`` reached) or
  ``"abort"``; the text of the token that stops a request is left out, as vLLM leaves it out (its id
  stays in ``token_ids``);
* it keeps the **log-probabilities** the runner computed
  (:mod:`~paged_kv.serving.logprobs`): each generated token's, with its text, beside the token, and
  the prompt's, whole, in the first output (vLLM's ``LogprobsProcessor``); with ``min_tokens``,
  stop strings are looked for only in the text after the first ``min_tokens`` tokens' (vLLM's
  detokenizer);
* it gathers the **children** of a request with ``n > 1`` (vLLM's ``ParentRequest``: child ``i`` is
  ``f"{i}_{request_id}"``) into one output per step, each child a :class:`CompletionOutput` with
  its ``index``; a ``FINAL_ONLY`` request is output once, when its last child finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from paged_kv.serving.logprobs import Logprob, PositionLogprobs, PromptLogprobs, SampleLogprobs, TokenLogprobs
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

Decode = Callable[[Sequence[int]], str]
"""A tokenizer's ``decode``: token ids to text."""


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM: ``CompletionOutput`` in ``vllm/outputs.py``).

    ``token_ids`` and ``text`` are all of it so far, or only what is new since the last output
    (``RequestOutputKind.DELTA``), and ``logprobs`` likewise, one dict per token, when the request
    asked for them (else ``None``); ``cumulative_logprob`` is the sum of all its tokens' so far.
    ``finish_reason`` is None while it runs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request produced in a step (vLLM: ``RequestOutput``): its prompt, the completions that
    changed (all of them for ``CUMULATIVE`` and ``FINAL_ONLY``), whether every completion has finished,
    and ``num_cached_tokens``, the prompt tokens the prefix cache served at its first admission.
    ``prompt_logprobs`` (when asked for) are the prompt's, ``None`` first: in every output, or in
    a ``DELTA`` request's first only."""

    request_id: Hashable
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Completion:
    """One child's state: its tokens and text, what has been sent, how it ended."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reported: bool = False
    """Whether an output carried its finish reason."""
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0


@dataclass
class _Parent:
    """A request as the client sent it, and its ``n`` children by their core ids."""

    request_id: Hashable
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    children: dict[Hashable, _Completion]
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    prompt_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def child_request_ids(request_id: Hashable, n: int) -> list[Hashable]:
    """The core's ids of a request's completions: the request's own for ``n == 1``, else vLLM's
    ``f"{i}_{request_id}"``."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_seed(seed: int | None, index: int) -> int | None:
    """Child ``index``'s seed: ``seed + index``, as vLLM's ``ParentRequest`` gives it (``None``: unseeded)."""
    return None if seed is None else seed + index


class OutputProcessor:
    """Turns the core's tokens into :class:`RequestOutput` objects (see the module).

    ``decode`` is the tokenizer's (None: no text, and no stop strings). Invariant: it knows exactly
    the requests added and not yet output as finished.
    """

    def __init__(self, decode: Decode | None = None) -> None:
        self.decode = decode
        self._parents: dict[Hashable, _Parent] = {}
        self._parent_of: dict[Hashable, _Parent] = {}  # a child's core id -> its parent
        self.last_finished: list[tuple[Hashable, str, int]] = []
        """The children the last :meth:`process_outputs` finished: core id, finish reason, tokens."""

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._parents

    def __len__(self) -> int:
        return len(self._parents)

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
    ) -> list[Hashable]:
        """Track a request (checked: its id not :meth:`in_use`, its stop strings readable); return its
        children's core ids."""
        ids = child_request_ids(request_id, params.n)
        parent = _Parent(
            request_id,
            list(prompt_token_ids),
            params,
            frozenset(() if params.ignore_eos else eos_token_ids),
            {child: _Completion(i) for i, child in enumerate(ids)},
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        self._parents[request_id] = parent
        for child in ids:
            self._parent_of[child] = parent
        return ids

    def in_use(self, request_id: Hashable, n: int = 1) -> bool:
        """Whether ``request_id``, or one of its ``n`` children's core ids, names a request tracked now
        (vLLM refuses a live id: "Request id ... already running"); a finished one's id is free."""
        ids = {request_id, *child_request_ids(request_id, n)}
        return not ids.isdisjoint(self._parents) or not ids.isdisjoint(self._parent_of)

    def request_ids(self) -> list[Hashable]:
        """The requests tracked: added and not yet output as finished."""
        return list(self._parents)

    def children(self, request_id: Hashable) -> list[Hashable]:
        """The core ids of ``request_id``'s children that are still running (none if unknown)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [child for child, c in parent.children.items() if c.finish_reason is None]

    def note_cached_tokens(self, child_id: Hashable, num_cached_tokens: int) -> None:
        """Record the prefix-cache hit of a child's first admission (the first child's counts)."""
        parent = self._parent_of.get(child_id)
        if parent is not None and parent.children[child_id].index == 0 and not parent.num_cached_tokens:
            parent.num_cached_tokens = num_cached_tokens

    def process_outputs(
        self,
        new_tokens: Mapping[Hashable, int],
        finished: Iterable[Hashable] = (),
        aborted: Iterable[Hashable] = (),
        logprobs: Mapping[Hashable, TokenLogprobs] | None = None,
        prompt_logprobs: Mapping[Hashable, Iterable[TokenLogprobs]] | None = None,
    ) -> tuple[list[RequestOutput], list[Hashable]]:
        """Apply one step: ``new_tokens`` (core id -> token), the core ids that ``finished`` in it
        (length or a stop token) and those ``aborted``, and the runner's ``logprobs`` and
        ``prompt_logprobs`` (core id -> its tokens'). Return the outputs, and the core ids that a
        stop string finished: the engine must finish them in the core."""
        done = set(finished)
        touched: dict[Hashable, _Parent] = {}
        stopped: list[Hashable] = []
        self.last_finished = ended = []
        for child_id, scored in (prompt_logprobs or {}).items():
            parent = self._parent_of.get(child_id)
            if parent is not None and parent.children[child_id].index == 0 and parent.prompt_logprobs:
                parent.prompt_logprobs += [self._position(t) for t in scored]
        logprobs = logprobs or {}
        for child_id, token in new_tokens.items():
            parent = self._parent_of.get(child_id)
            if parent is None:
                continue
            c = parent.children[child_id]
            if c.finish_reason is not None:
                continue
            c.token_ids.append(token)
            if child_id in logprobs:
                position = self._position(logprobs[child_id])
                c.logprobs.append(position)
                c.cumulative_logprob += position[token].logprob
            by_token = child_id in done
            stop_token = by_token and (token in parent.eos_token_ids or token in parent.params.stop_token_ids)
            self._detokenize(parent, c, stop_token)
            if c.finish_reason is None and by_token:
                self._finish_by_token(parent, c, token)
            elif c.finish_reason is not None and not by_token:  # a stop string: the core must let it go
                stopped.append(child_id)
            if c.finish_reason is not None:
                ended.append((child_id, c.finish_reason, len(c.token_ids)))
            touched[parent.request_id] = parent
        for child_id in aborted:
            parent = self._parent_of.get(child_id)
            if parent is not None and parent.children[child_id].finish_reason is None:
                c = parent.children[child_id]
                c.finish_reason = "abort"
                ended.append((child_id, c.finish_reason, len(c.token_ids)))
                touched[parent.request_id] = parent
        outputs = [out for parent in touched.values() if (out := self._output(parent)) is not None]
        return outputs, stopped

    # ------------------------------------------------------------------------------ the helpers

    def _position(self, scored: TokenLogprobs) -> PositionLogprobs:
        """One position's dict, token id to :class:`Logprob` with its text, the chosen token first
        (its rank its own; the others' their place in the top k)."""
        decode = self.decode
        ranks = (scored.rank, *range(1, len(scored.token_ids)))
        position: PositionLogprobs = {}
        for token, logprob, rank in zip(scored.token_ids, scored.logprobs, ranks, strict=True):
            if token not in position:
                position[token] = Logprob(logprob, rank, None if decode is None else decode([token]))
        return position

    def _detokenize(self, parent: _Parent, c: _Completion, stop_token: bool = False) -> None:
        """The completion's text, without the stop token that ended it (as vLLM's detokenizer), and
        cut before the first stop string found after the first ``min_tokens`` tokens' text (which
        then ends it)."""
        if self.decode is None:
            return
        c.text = self.decode(c.token_ids[:-1] if stop_token else c.token_ids)
        min_tokens = parent.params.min_tokens
        if min_tokens and len(c.token_ids) <= min_tokens:
            return
        start = len(self.decode(c.token_ids[:min_tokens])) if min_tokens else 0
        for stop in parent.params.stop:
            at = c.text.find(stop, start)
            if at != -1:
                c.text = c.text[:at]
                c.finish_reason, c.stop_reason = "stop", stop
                return

    def _finish_by_token(self, parent: _Parent, c: _Completion, token: int) -> None:
        if token in parent.eos_token_ids:  # vLLM's check_stop: the end of sequence first
            c.finish_reason = "stop"
        elif token in parent.params.stop_token_ids:
            c.finish_reason, c.stop_reason = "stop", token
        else:
            c.finish_reason = "length"

    def _output(self, parent: _Parent) -> RequestOutput | None:
        """The parent's output after a step that touched it (None for ``FINAL_ONLY`` until it ends);
        a finished parent is forgotten."""
        finished = parent.finished
        kind = parent.params.output_kind
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._parent_of.pop(child, None)
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for c in parent.children.values():
            shown = c.text if c.finish_reason is not None else _sendable(c.text, parent.params)
            new = c.sent_tokens < len(c.token_ids) or c.sent_chars < len(shown)
            if kind is RequestOutputKind.DELTA:
                if not new and (c.reported or c.finish_reason is None):
                    continue  # nothing this child has not sent
                text, ids, scored = shown[c.sent_chars :], c.token_ids[c.sent_tokens :], c.sent_tokens
            else:
                text, ids, scored = shown, list(c.token_ids), 0
            wants = parent.params.logprobs is not None
            c.sent_tokens, c.sent_chars = len(c.token_ids), max(c.sent_chars, len(shown))
            c.reported = c.finish_reason is not None
            completions.append(
                CompletionOutput(
                    c.index,
                    text,
                    ids,
                    c.finish_reason,
                    c.stop_reason,
                    c.logprobs[scored:] if wants else None,
                    c.cumulative_logprob if wants else None,
                )
            )
        prompt_logprobs = parent.prompt_logprobs
        if kind is RequestOutputKind.DELTA and parent.prompt_sent:
            prompt_logprobs = None
        parent.prompt_sent = True
        return RequestOutput(
            parent.request_id,
            parent.prompt_token_ids,
            completions,
            finished,
            parent.num_cached_tokens,
            None if prompt_logprobs is None else list(prompt_logprobs),
        )


def _sendable(text: str, params: SamplingParams) -> str:
    """The text a running completion may show: without an incomplete last character, and without
    the tail that could still become a stop string."""
    text = text.rstrip("\ufffd")
    hold = params.stop_buffer_length if params.stop else 0
    return text[: max(len(text) - hold, 0)]
