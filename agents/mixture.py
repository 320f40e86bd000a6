"""Which of the curriculum's examples a stage trains on: the Pruner's labels balanced, a dedicated stage's focus.

The curriculum gives every example of its steps (:meth:`agents.curriculum.AgentCurriculum.examples`); ~70 % of the
Pruner's targets are "no" (docs/training.md, "The agents' curriculum"). A :class:`Mixture` resamples them, the
same way for the same seed:

- ``balance_pruner``: the Pruner's "yes" and "no" examples made equal in number by repeating the smaller label's
  examples (whole copies, then a seeded draw without replacement for the remainder), so no example is dropped;
- ``focus`` and ``others_share``: a dedicated stage on the ``focus`` steps (e.g. ``[pruner]``, started from a trained
  generator with ``generator_training.init_from``): every focus example, and examples of the other trained steps
  drawn (seeded, without replacement) so that they make up ``others_share`` of the stage's examples, to keep those
  steps reading. ``others_share = 0`` trains the focus steps alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

PRUNER = "pruner"
LABELS = ("yes", "no")
KEY = "generator_training.curriculum"


def balanced(labels: Sequence[str], rng: random.Random) -> list[int]:
    """Positions in ``labels`` (sorted, with repeats) at which each of :data:`LABELS` occurs equally often: the
    smaller label's indices repeated whole, then the remainder drawn without replacement from them."""
    groups = {label: [i for i, value in enumerate(labels) if value == label] for label in LABELS}
    if empty := [label for label, group in groups.items() if not group]:
        raise ValueError(f"{KEY}.balance_pruner: the Pruner's {len(labels)} examples have no {empty[0]!r} target, "
                         "so its labels cannot be balanced")
    size = max(len(group) for group in groups.values())
    chosen = []
    for group in groups.values():
        copies, remainder = divmod(size, len(group))
        chosen += group * copies + rng.sample(group, remainder)
    return sorted(chosen)


@dataclass(frozen=True)
class Mixture:
    """How a stage resamples the curriculum's examples (``generator_training.curriculum``: ``balance_pruner``,
    ``focus``, ``others_share``); :meth:`check` them against the trained steps first."""

    balance_pruner: bool = False
    focus: tuple[str, ...] = ()
    others_share: float = 0.0

    def check(self, steps: Sequence[str]) -> None:
        """Refuse settings that cannot apply to ``steps`` (the curriculum's), naming the value."""
        if self.balance_pruner and PRUNER not in steps:
            raise ValueError(f"{KEY}.balance_pruner=true but {KEY}.steps={list(steps)} has no {PRUNER!r} step: "
                             "there are no Pruner labels to balance")
        if unknown := [step for step in self.focus if step not in steps]:
            raise ValueError(f"{KEY}.focus={list(self.focus)} names {unknown}, not in {KEY}.steps={list(steps)}")
        if not 0 <= self.others_share < 1:
            raise ValueError(f"{KEY}.others_share={self.others_share}: expected a share in [0, 1) of the stage's "
                             "examples")
        if self.others_share and not self.focus:
            raise ValueError(f"{KEY}.others_share={self.others_share} needs {KEY}.focus (the steps the stage is "
                             "for); without a focus every step is trained in full")
        if self.others_share and set(steps) <= set(self.focus):
            raise ValueError(f"{KEY}.others_share={self.others_share} but {KEY}.steps={list(steps)} has no step "
                             f"outside {KEY}.focus={list(self.focus)} to draw from")

    def apply(self, steps: Sequence[str], targets: Sequence[str], seed: int) -> list[int]:
        """Indices (sorted, with repeats) of the examples the stage trains on, given each example's step and target;
        the identity when nothing is set."""
        rng = random.Random(seed)
        pruner = [i for i, step in enumerate(steps) if step == PRUNER]
        rest = [i for i, step in enumerate(steps) if step != PRUNER]
        if self.balance_pruner:
            pruner = [pruner[i] for i in balanced([targets[i] for i in pruner], rng)]
        chosen = sorted(pruner + rest)
        if not self.focus:
            return chosen
        focus = [i for i in chosen if steps[i] in self.focus]
        others = [i for i in chosen if steps[i] not in self.focus]
        wanted = round(self.others_share * len(focus) / (1 - self.others_share))
        if wanted > len(others):
            raise ValueError(f"{KEY}.others_share={self.others_share} asks for {wanted} examples of the other steps "
                             f"beside {len(focus)} focus examples, but the curriculum has {len(others)}")
        return sorted(focus + rng.sample(others, wanted))
