"""The prompt-prefix cache of the local LVLM backends: language-model keys and values of earlier prompts.

A one-request call whose prompt starts like an earlier one's (the same tokens and the same pages, up to
the end of at least one page) reuses the keys and values of that prefix and prefills only the rest
(docs/lvlm.md, "Prefix reuse").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]
"""One row's keys and values per decoder layer, each ``(1, heads, tokens, head_dim)``."""


@dataclass(frozen=True)
class PromptLayout:
    """One prompt as the prefix cache compares prompts: its token ids and each page's feature key and span.

    Image tokens carry the same ids whatever the page shows, so two prompts share their first ``n`` tokens
    when those ids are equal *and* every page starting among them has the same key.
    """

    ids: torch.Tensor
    pages: tuple[Hashable, ...]
    spans: tuple[tuple[int, int], ...]

    @property
    def key(self) -> Hashable:
        return tuple(self.ids.tolist()), self.pages

    def __len__(self) -> int:
        return len(self.ids)

    def shared_length(self, other: PromptLayout) -> int:
        """How many leading tokens this prompt shares with ``other``."""
        n = min(len(self), len(other))
        differ = (self.ids[:n] != other.ids[:n]).nonzero()
        length = int(differ[0]) if len(differ) else n
        for mine, theirs, (start, _) in zip(self.pages, other.pages, self.spans):
            if start >= length:
                break
            if mine != theirs:
                return start
        return length

    def whole_pages(self, length: int) -> tuple[int, int]:
        """``(tokens, pages)``: ``length`` cut back to a page boundary, and the pages ending within it."""
        for count, (start, end) in enumerate(self.spans):
            if end > length:
                return min(length, start), count
        return length, len(self.spans)

    def head(self, length: int) -> PromptLayout:
        """The first ``length`` tokens, with the pages ending within them."""
        pages = sum(end <= length for _, end in self.spans)
        return PromptLayout(self.ids[:length], self.pages[:pages], self.spans[:pages])


@dataclass
class PrefixReuse:
    """A cache hit: the keys and values of the prompt's first ``tokens`` tokens, which hold its first ``pages``."""

    tokens: int
    pages: int
    key_values: KeyValues


class PrefixCache:
    """A bounded LRU of prompt prefixes' keys and values, ``capacity == 0`` keeps nothing.

    An entry is a prompt cut after its last page. A lookup finds the entry sharing the most leading tokens
    with a prompt, cut back to a page boundary and to one token short of the prompt (the last token is
    always prefilled, for its logits); it hits when that covers at least one whole page. Storing a prompt
    drops the entries it extends (the Pruner's pages 1..n keep one entry, not n) and stores nothing when an
    entry extends it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"prefix_cache_size must be >= 0, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, tuple[PromptLayout, KeyValues]] = OrderedDict()
        self.hits = self.misses = self.reused_tokens = 0

    def lookup(self, prompt: PromptLayout) -> PrefixReuse | None:
        """The longest reusable prefix of ``prompt`` (a view of the entry: reusing it must not write to it)."""
        best, best_key = 0, None
        for key, (prefix, _) in self.entries.items():
            shared = min(prompt.shared_length(prefix), len(prompt) - 1)
            if shared > best:
                best, best_key = shared, key
        tokens, pages = prompt.whole_pages(best)
        if not pages:
            self.misses += 1
            return None
        self.hits += 1
        self.reused_tokens += tokens
        self.entries.move_to_end(best_key)
        key_values = [(k[..., :tokens, :], v[..., :tokens, :]) for k, v in self.entries[best_key][1]]
        return PrefixReuse(tokens, pages, key_values)

    def store(self, prompt: PromptLayout, cache: DynamicCache) -> None:
        """Keep ``cache``'s keys and values of ``prompt`` up to its last page (copied: ``cache`` may grow)."""
        if not self.capacity or not prompt.spans:
            return
        prefix = prompt.head(prompt.spans[-1][1])
        holder = next((key for key, (old, _) in self.entries.items() if prefix.shared_length(old) == len(prefix)), None)
        if holder is not None:
            self.entries.move_to_end(holder)
            return
        key_values = layer_prefix(cache, len(prefix))
        if key_values is None:
            return
        for key in [key for key, (old, _) in self.entries.items() if prefix.shared_length(old) == len(old)]:
            del self.entries[key]
        self.entries[prefix.key] = (prefix, key_values)
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


def layer_prefix(cache: DynamicCache, length: int) -> KeyValues | None:
    """Copies of each layer's first ``length`` keys and values; ``None`` when a layer no longer holds them
    all (a sliding-window layer past its window)."""
    layers = cache.layers
    if any(layer.keys is None or not length <= layer.keys.shape[-2] == layer.get_seq_length() for layer in layers):
        return None
    return [(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone()) for layer in layers]
