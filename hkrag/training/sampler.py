"""Deterministic global batches for contrastive training, resumable at any step.

Each epoch is a seeded permutation cut into global batches of ``global_batch_size``; rank ``r`` of
``W`` takes the ``r``-th contiguous slice of every global batch, so the union over ranks is exactly the
batch one process would see (what the cross-device negatives assume). The last incomplete batch is
dropped: every rank must hold the same number of rows. Resuming at step ``s`` is just skipping ``s``
batches of the same permutation — no data has to be read to get there.

With ``groups`` (e.g. the document each positive page belongs to), the permutation shuffles groups
and the items inside each group, then lays each group's items side by side, so pages of one
document meet in a batch as hard negatives.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import torch


class GlobalBatchSampler:
    """Yields this rank's indices for each global batch of an epoch."""

    def __init__(
        self,
        num_items: int,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        groups: Sequence[Hashable] | None = None,
    ):
        if global_batch_size % world_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by {world_size} processes")
        if num_items < global_batch_size:
            raise ValueError(
                f"only {num_items} training pairs for a global batch of {global_batch_size}; lower the batch size"
            )
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // world_size
        self.rank = rank
        self.seed = seed
        if groups is not None and len(groups) != num_items:
            raise ValueError(f"{len(groups)} group keys for {num_items} items")
        self.groups = groups
        self._cached: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Optimizer steps per epoch."""
        return self.num_items // self.global_batch_size

    def order(self, epoch: int) -> list[int]:
        """The epoch's item order: a seeded permutation, grouped when ``groups`` is set (cached per epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._permute(epoch))
        return self._cached[1]

    def _permute(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_items, generator=generator).tolist()
        if self.groups is None:
            return order
        members: dict[Hashable, list[int]] = {}
        for index in order:
            members.setdefault(self.groups[index], []).append(index)
        keys = list(members)
        return [i for k in torch.randperm(len(keys), generator=generator).tolist() for i in members[keys[k]]]

    def global_batch(self, epoch: int, step: int) -> list[int]:
        """Every rank's indices of one global batch, in rank order."""
        return self.order(epoch)[step * self.global_batch_size : (step + 1) * self.global_batch_size]

    def batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """Local index lists of ``epoch``, from step ``start`` on."""
        order = self.order(epoch)
        lo = self.rank * self.local_batch_size
        for step in range(start, len(self)):
            batch = order[step * self.global_batch_size : (step + 1) * self.global_batch_size]
            yield batch[lo : lo + self.local_batch_size]
