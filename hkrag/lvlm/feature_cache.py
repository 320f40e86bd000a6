"""The page-feature cache of the local LVLM backends: each page's image features, computed once.

The agents ask several questions about the same pages; a bounded LRU keyed by the page's feature key
lets the vision tower run once per page (docs/lvlm.md, "Local backends").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class FeatureCache:
    """A bounded LRU map from a page key to its image features; ``capacity == 0`` keeps nothing."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"feature_cache_size must be >= 0, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The cached value of ``key``, or ``compute()`` (stored, evicting the least recently used)."""
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        value = compute()
        if self.capacity:
            self.entries[key] = value
            if len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)
