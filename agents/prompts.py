"""The agents' prompts: one set, read from the generator config (``conf/generator/hkrag.yaml``, ``prompts:``).

Each prompt is a ``str.format`` template of the text that follows the page images in a single user turn
(pages first, in ranked order, so every call of a query shares the same page prefix: a server's prefix
cache and a local backend's feature cache reuse it). Templates are checked when loaded: each may only use
its own placeholders (literal braces are written ``{{`` and ``}}``), and each must use ``{question}``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from hkrag.lvlm import GenerationSettings, LVLMRequest, PageImage

NOTES = frozenset({"question", "salient", "fine_print"})
PLACEHOLDERS: dict[str, frozenset[str]] = {
    "pruner": frozenset({"question", "n"}),
    "answer": frozenset({"question"}),
    "single_pass": frozenset({"question"}),
    "verify": frozenset({"question"}),
    "salient": frozenset({"question"}),
    "fine_print": NOTES,
    "decouple": NOTES,
    "integrate": NOTES,
}
"""The placeholders each template may use."""


@dataclass(frozen=True)
class Prompts:
    """The templates of every agent step and the Decoupler's stopping marker.

    ``pruner`` (Eq. 6, pages 1..n): do these pages suffice? yes/no. ``answer``: the Judger's initial answer
    (Definition 1). ``single_pass``: the single-pass baseline, VDocGenerator's own prompt (DESIGN §11:
    ``"{question}\\n Answer briefly."`` after the page images). ``verify``: the Summarizer's LQP
    verification, a fresh answer from the pages and question (the initial answer is never model input).
    ``salient``: the Decoupler's I_h. ``fine_print``: I_d(t) = Θ(I_h, I_d(t−1)) (Eq. 7). ``decouple``:
    I′_d(t) = Θ(I_h, I_d(t)) (Eq. 8), ending with ``answered_marker`` then yes or no. ``integrate``: the
    Summarizer's HQP answer. ``no_notes``: what ``{fine_print}`` holds before the first iteration.
    """

    pruner: str
    answer: str
    single_pass: str
    verify: str
    salient: str
    fine_print: str
    decouple: str
    integrate: str
    answered_marker: str
    no_notes: str

    def __post_init__(self) -> None:
        for name, allowed in PLACEHOLDERS.items():
            used = placeholders(getattr(self, name), name)
            if unknown := used - allowed:
                raise ValueError(
                    f"prompt {name!r} uses unknown placeholders {sorted(unknown)}; allowed: {sorted(allowed)}"
                )
            if "question" not in used:
                raise ValueError(f"prompt {name!r} must contain {{question}}")
        if not self.answered_marker.strip():
            raise ValueError("prompts.answered_marker must not be empty")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Prompts:
        """The prompts of a config mapping; names the missing or unknown keys."""
        names = {f.name for f in fields(cls)}
        if missing := names - set(config):
            raise ValueError(f"generator config 'prompts' lacks {sorted(missing)}")
        if unknown := set(config) - names:
            raise ValueError(f"generator config 'prompts' has unknown keys {sorted(unknown)}; expected {sorted(names)}")
        return cls(**{name: str(config[name]) for name in names})

    def render(self, name: str, **values: Any) -> str:
        """The text of prompt ``name`` with its placeholders filled."""
        return getattr(self, name).format(**values)


def placeholders(template: str, name: str) -> set[str]:
    """The field names ``template`` uses; a malformed template is an error naming the prompt."""
    try:
        return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:
        raise ValueError(f"prompt {name!r} is not a valid format string ({error})") from error


def build_request(pages: Sequence[PageImage], text: str, settings: GenerationSettings) -> LVLMRequest:
    """One user turn: the page images in ranked order, then the prompt text."""
    return LVLMRequest.user(*pages, text, settings=settings)


def shown(pages: Sequence[PageImage], text: str) -> str:
    """The prompt as the trace records it: each page shown as ``<page:id>``, then the text."""
    return "".join(f"<page:{page.key}>\n" for page in pages) + text
