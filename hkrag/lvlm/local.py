"""Shared machinery of the local (transformers) LVLM backends: batching, generation, token statistics.

A local backend (:mod:`hkrag.lvlm.phi3v`, :mod:`hkrag.lvlm.qwen2_5_vl`) only says how to turn chat
messages into model inputs and how to compute one page's image features; :class:`LocalBackend` does the
rest the same way for both:

* requests with identical :class:`GenerationSettings` are batched, ``batch_size`` at a time, left-padded
  (both models derive positions from the attention mask, so padding changes no result);
* ``generate`` runs with a KV cache and ``output_logits=True``: the per-token log-probabilities are the
  log-softmax of the model's *own* logits at each step (before temperature / top-p), so greedy
  log-probabilities are the model's true distribution and the full-distribution entropy is exact;
* the answer ends at the first end token (``finish_reason="stop"``), at the first stop string (text and
  tokens cut together), or at ``max_new_tokens`` (``"length"``); the end token is not part of the answer
  (the end-token rule of :class:`~hkrag.lvlm.base.LVLMBackend`);
* a request holding a lone surrogate raises :class:`~hkrag.lvlm.base.LVLMTextError` naming its message part;
* a request whose prompt, or prompt plus ``max_new_tokens``, does not fit the model's context raises
  :class:`~hkrag.lvlm.base.LVLMContextError` naming both lengths before anything is generated (never cut);
* a request naming ``word_mass`` words gets, at every generated token, each word's log-probability summed over
  every vocabulary token that reads as it (:mod:`hkrag.lvlm.words`), from the full distribution;
* NaN logits at any generated step (an overflow, a broken checkpoint) raise
  :class:`~hkrag.lvlm.base.LVLMResponseError` instead of yielding a NaN or silently zero uncertainty;
* page image features are computed one page at a time and kept in a bounded LRU cache keyed by the
  page's key (:mod:`hkrag.lvlm.feature_cache`), so the several questions the agents ask about the same
  pages run the vision tower once;
* a one-request call whose prompt starts like an earlier one's (the same tokens and the same pages, up
  to the end of at least one page) reuses the language model's keys and values of that prefix from a
  bounded LRU :class:`~hkrag.lvlm.prefix_cache.PrefixCache` and prefills only the rest. The agents put
  the pages first, so the Pruner's pages 1..n, the initial answer and the verification each prefill only
  their new pages and text.
"""

from __future__ import annotations

import itertools
import time
from abc import abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
)

from .base import (
    GenerationSettings,
    LVLMBackend,
    LVLMContextError,
    LVLMRequest,
    LVLMResponseError,
    LVLMResult,
    PageImage,
    TokenLogprob,
    check_context,
    check_text,
)
from .feature_cache import FeatureCache
from .prefix_cache import PrefixCache, PromptLayout
from .words import vocabulary_word_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"``: bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


@dataclass
class TokenStatistics:
    """Per generated token of a batch: chosen log-probability, entropy (nats), top-k ids and log-probs, and the
    ``(B, T, W)`` log-masses of the requested words (``W`` = 0 when none were asked for)."""

    logprobs: torch.Tensor
    entropies: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    vocab_size: int
    word_logprobs: torch.Tensor | None = None


def token_statistics(step_logits: Sequence[torch.Tensor], chosen: torch.Tensor, top_k: int,
                     word_ids: Sequence[Sequence[int]] = ()) -> TokenStatistics:
    """Statistics of the ``(B, T)`` chosen tokens under the model's ``T`` steps of ``(B, V)`` raw logits.

    ``log p = log_softmax(logits)`` in float32; entropy ``H = −Σ_v p_v log p_v`` over the whole vocabulary,
    a token with ``log p = −inf`` (a masked logit) adding 0; each ``word_ids`` entry's mass is
    ``log Σ_{v in ids} p_v`` (−inf for no ids). NaN logits give NaN statistics (never hidden).
    One step at a time, so memory stays ``O(B·V)`` whatever ``T`` is.
    """
    logprobs, entropies, top_ids, top_values, words = [], [], [], [], []
    for step, logits in enumerate(step_logits):
        log_p = torch.log_softmax(logits.float(), dim=-1)
        words.append(torch.stack([torch.logsumexp(log_p[:, list(ids)], dim=-1) if ids else
                                  torch.full(log_p.shape[:1], -torch.inf) for ids in word_ids], -1)
                     if word_ids else log_p[:, :0])
        logprobs.append(log_p.gather(-1, chosen[:, step : step + 1]).squeeze(-1))
        terms = torch.where(log_p == -torch.inf, 0.0, log_p.exp() * log_p)
        entropies.append(-terms.sum(-1))
        values, ids = log_p.topk(top_k, dim=-1) if top_k else (log_p[:, :0], log_p[:, :0].long())
        top_values.append(values)
        top_ids.append(ids)
    return TokenStatistics(
        torch.stack(logprobs, 1).cpu(),
        torch.stack(entropies, 1).cpu(),
        torch.stack(top_ids, 1).cpu(),
        torch.stack(top_values, 1).cpu(),
        step_logits[0].shape[-1],
        torch.stack(words, 1).cpu(),
    )


def token_texts(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """Each token's text as the difference of decoded prefixes, so ``"".join(texts) == decode(ids)``.

    Decoding tokens one by one would drop SentencePiece's leading spaces and split UTF-8 characters.
    """
    texts, previous = [], ""
    for end in range(1, len(ids) + 1):
        current = tokenizer.decode(ids[:end], skip_special_tokens=True)
        texts.append(current[len(previous) :] if current.startswith(previous) else current)
        previous = current
    return texts


def cut_at_stop(texts: Sequence[str], stop: Sequence[str]) -> tuple[str, int, int | None]:
    """Cut an answer at its first stop string: ``(text before it, tokens to keep, tokens through its end)``.

    The kept tokens are the fewest whose text reaches the cut (a token straddling the cut is kept: it
    produced the answer's last characters); the third value counts the tokens generated up to the end of
    the stop string (where generation stopped), ``None`` when no stop string occurs.
    """
    full = "".join(texts)
    found = [(index, len(s)) for s in stop if s and (index := full.find(s)) >= 0]
    if not found:
        return full, len(texts), None
    cut, width = min(found)
    ends = [len(part) for part in itertools.accumulate(texts)]
    keep = next(count for count, end in enumerate([0, *ends]) if end >= cut)
    through = next(count for count, end in enumerate(ends, start=1) if end >= cut + width)
    return full[:cut], keep, through


class StopOnStrings(StoppingCriteria):
    """Ends a row once its generated text (after ``prompt_length``) contains a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str], prompt_length: int) -> None:
        self.tokenizer, self.stop, self.prompt_length = tokenizer, [s for s in stop if s], prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_length :], skip_special_tokens=True)
        done = [any(s in text for s in self.stop) for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def generation_config(settings: GenerationSettings, end_ids: Sequence[int], pad_id: int) -> GenerationConfig:
    """A complete config: every sampling knob set, so a checkpoint's ``generation_config.json`` (Qwen's sets
    ``repetition_penalty``, ``top_k``, a low temperature) cannot change greedy decoding behind our back."""
    common = dict(
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=list(end_ids),
        pad_token_id=pad_id,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    if settings.greedy:
        return GenerationConfig(do_sample=False, temperature=1.0, top_p=1.0, **common)
    return GenerationConfig(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0, **common)


@dataclass
class ModelInputs:
    """A left-padded batch for ``generate``: its keyword arguments, each row's prompt length in tokens and
    each row's pages as ``(feature key, image tokens)`` in prompt order."""

    kwargs: dict[str, Any]
    prompt_tokens: list[int]
    pages: list[list[tuple[Hashable, int]]] = field(default_factory=list)


def context_length(config: PretrainedConfig) -> int | None:
    """The model's context in tokens: ``max_position_embeddings`` of its config or of its ``text_config``."""
    return getattr(config, "max_position_embeddings", None) or getattr(
        getattr(config, "text_config", None), "max_position_embeddings", None)


class LocalBackend(LVLMBackend):
    """Base of the in-process backends. Subclasses implement :meth:`prepare` and :meth:`page_features`.

    Args:
        model: the causal vision-language model (eval mode, on its device).
        tokenizer: its tokenizer (decodes the answers).
        model_name: what produced the answers, written into every result.
        end_tokens: token strings that end an answer (looked up in the vocabulary).
        batch_size: requests per ``generate`` call.
        feature_cache_size: pages whose image features are kept (0 disables reuse).
        prefix_cache_size: prompt prefixes whose keys and values are kept (0 disables reuse).

    Every token carries its full-distribution entropy (``exact_entropy``) and the full-vocabulary mass of the
    words its request names (``exact_word_mass``); ``vocab_size`` is the LM head's output size (the ``|V|`` of
    the normalised entropy).
    """

    exact_entropy = True
    exact_word_mass = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        end_tokens: Sequence[str],
        batch_size: int = 4,
        feature_cache_size: int = 32,
        prefix_cache_size: int = 8,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lm = model.eval()
        self.tokenizer = tokenizer
        self.model = model_name
        self.batch_size = batch_size
        self.features = FeatureCache(feature_cache_size)
        self.prefixes = PrefixCache(prefix_cache_size)
        self.end_ids = end_token_ids(tokenizer, end_tokens)
        head = model.get_output_embeddings()
        self.vocab_size = None if head is None else int(head.weight.shape[0])
        self.context_length = context_length(model.config)
        self._vocabulary: list[str] | None = None

    def word_ids(self, words: Sequence[str]) -> list[list[int]]:
        """For each of ``words``, the vocabulary ids (below the LM head's size) whose decoded text reads as it or that
        the tokenizer starts its spelling with (:func:`~hkrag.lvlm.words.vocabulary_word_ids`)."""
        if not words:
            return []
        if self._vocabulary is None:
            size = len(self.tokenizer) if self.vocab_size is None else min(len(self.tokenizer), self.vocab_size)
            self._vocabulary = [self.tokenizer.decode([token_id]) for token_id in range(size)]
        return vocabulary_word_ids(self._vocabulary, words,
                                   lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_prompt_tokens(self, request: LVLMRequest) -> int:
        """The prompt's tokens, page tokens included (:meth:`prepare`: page features, no decoding)."""
        return self.prepare([request]).prompt_tokens[0]

    @property
    def device(self) -> torch.device:
        return self.lm.get_input_embeddings().weight.device

    @abstractmethod
    def prepare(self, requests: Sequence[LVLMRequest]) -> ModelInputs:
        """The left-padded ``generate`` inputs of a batch of requests (image features from :meth:`page`)."""

    @abstractmethod
    def page_features(self, page: PageImage) -> Any:
        """One page's image features, computed afresh (the cache wraps this)."""

    @abstractmethod
    def is_image_token(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` are image placeholders (a boolean mask)."""

    @abstractmethod
    def skip_pages(self, kwargs: dict[str, Any], pages: int, tokens: int) -> None:
        """Drop from ``kwargs`` the features of the first ``pages`` pages (``tokens`` image tokens), whose
        keys and values come from the prefix cache: ``generate`` prefills only the tokens after them."""

    def feature_key(self, page: PageImage) -> Hashable:
        """What identifies a page's features: its key (subclasses add preprocessing settings)."""
        return page.key

    @torch.inference_mode()
    def page(self, page: PageImage) -> Any:
        """One page's image features, from the cache when this page was seen recently."""
        return self.features.get(self.feature_key(page), lambda: self.page_features(page))

    def generate(self, requests: Sequence[LVLMRequest]) -> list[LVLMResult]:
        results: list[LVLMResult | None] = [None] * len(requests)
        groups: dict[GenerationSettings, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.settings, []).append(index)
        for settings, indices in groups.items():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                for index, result in zip(chunk, self.generate_batch([requests[i] for i in chunk], settings)):
                    results[index] = result
        return results

    @torch.inference_mode()
    def generate_batch(self, requests: Sequence[LVLMRequest], settings: GenerationSettings) -> list[LVLMResult]:
        """One ``generate`` call for requests sharing ``settings``; latency is the batch's wall time."""
        start = time.perf_counter()
        for request in requests:
            check_text(request)
        inputs = self.prepare(requests)
        for row, tokens in enumerate(inputs.prompt_tokens):
            try:
                check_context(tokens, settings.max_new_tokens, self.context_length)
            except LVLMContextError as error:
                raise LVLMContextError(f"{self.model}: request {row} of the batch: {error}", error.field) from None
        prompt_length = inputs.kwargs["input_ids"].shape[1]
        stopping = [StopOnStrings(self.tokenizer, settings.stop, prompt_length)] if settings.stop else []
        layout = self.layout(inputs) if len(requests) == 1 and self.prefixes.capacity else None
        reuse = self.prefixes.lookup(layout) if layout is not None else None
        if reuse is not None:
            self.skip_pages(inputs.kwargs, reuse.pages, sum(count for _, count in inputs.pages[0][: reuse.pages]))
            inputs.kwargs["past_key_values"] = DynamicCache(reuse.key_values, config=self.lm.config)
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        out = self.lm.generate(
            **inputs.kwargs,
            generation_config=generation_config(settings, self.end_ids, self.tokenizer.pad_token_id),
            stopping_criteria=stopping,
        )
        if layout is not None:
            self.prefixes.store(layout, out.past_key_values)
        generated = out.sequences[:, prompt_length:]
        stats = token_statistics(out.logits, generated, settings.top_logprobs, self.word_ids(settings.word_mass))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        latency = time.perf_counter() - start
        return [
            self.result(row, generated[row].tolist(), stats, settings, inputs.prompt_tokens[row], latency)
            for row in range(len(requests))
        ]

    def result(
        self,
        row: int,
        ids: list[int],
        stats: TokenStatistics,
        settings: GenerationSettings,
        prompt_tokens: int,
        latency: float,
    ) -> LVLMResult:
        """One row's answer, cut at its first end token or stop string, with its tokens' statistics.

        ``tokens`` are the answer's tokens (no end token, nothing of the stop string past a straddling
        token); ``completion_tokens`` counts every token generated, the end token or stop string included.
        NaN statistics at any of those steps raise :class:`LVLMResponseError`.
        """
        end = next((i for i, token in enumerate(ids) if token in self.end_ids), None)
        answer = ids if end is None else ids[:end]
        texts = token_texts(self.tokenizer, answer)
        text, keep, through_stop = cut_at_stop(texts, settings.stop)
        if through_stop is not None:
            finish, completion = "stop", through_stop
        elif end is not None:
            finish, completion = "stop", end + 1
        else:
            finish, completion = "length", len(ids)
        self.check_finite(stats, row, completion)
        tokens = [
            TokenLogprob(
                token=texts[i],
                logprob=float(stats.logprobs[row, i]),
                token_id=answer[i],
                top=[
                    (self.tokenizer.decode([int(t)]), float(lp))
                    for t, lp in zip(stats.top_ids[row, i], stats.top_logprobs[row, i])
                ],
                entropy=float(stats.entropies[row, i]),
                words=({word: float(stats.word_logprobs[row, i, w]) for w, word in enumerate(settings.word_mass)}
                       if settings.word_mass else None),
            )
            for i in range(keep)
        ]
        return LVLMResult(
            text=text,
            tokens=tokens,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            latency_s=latency,
            finish_reason=finish,
            backend=self.name,
            model=self.model,
            vocab_size=stats.vocab_size,
        )

    def check_finite(self, stats: TokenStatistics, row: int, steps: int) -> None:
        """:class:`LVLMResponseError` when a row's first ``steps`` generated tokens have NaN statistics."""
        bad = (stats.logprobs[row, :steps].isnan() | stats.entropies[row, :steps].isnan()).nonzero()
        if len(bad):
            step = int(bad[0, 0])
            raise LVLMResponseError(f"{self.model}: the model's logits are NaN at generated token {step} (request "
                                    f"{row} of the batch); its probabilities are unusable (check the dtype)")

    def layout(self, inputs: ModelInputs) -> PromptLayout:
        """The first row's prompt as the prefix cache compares it (a one-row batch: no padding)."""
        ids = inputs.kwargs["input_ids"][0].cpu()
        positions = self.is_image_token(ids).nonzero().squeeze(1).tolist()
        keys, counts = zip(*inputs.pages[0]) if inputs.pages[0] else ((), ())
        if sum(counts) != len(positions):
            raise ValueError(f"the prompt holds {len(positions)} image tokens but its pages give {sum(counts)}")
        ends = list(itertools.accumulate(counts))
        spans = tuple((positions[end - count], positions[end - 1] + 1) for end, count in zip(ends, counts))
        return PromptLayout(ids, tuple(keys), spans)

    def close(self) -> None:
        self.features.clear()
        self.prefixes.clear()


def end_token_ids(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[str]) -> list[int]:
    """Ids of the end-of-answer tokens, looked up by their strings; an absent token is an error."""
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"end token {token!r} is not in the tokenizer's vocabulary")
        ids.append(token_id)
    return ids
