"""The agents' prompts: one set, read from the generator config (``conf/generator/hkrag.yaml``, ``prompts:``).

Each prompt is a ``str.format`` template of the text that follows the page images in a single user turn
(pages first, in ranked order, so every call of a query shares the same page prefix: a server's prefix
cache and a local backend's feature cache reuse it). Templates are checked when loaded: each may only use
its step's placeholders (:data:`agents.steps.STEPS`; literal braces are written ``{{`` and ``}}``), and
each must use ``{question}``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hkrag.lvlm import GenerationSettings, LVLMRequest
from hkrag.rag.records import Page, page_content, page_marker

from .steps import STEPS

EXTRAS = ("answered_marker", "no_notes")
"""The ``prompts:`` entries that are not templates."""


@dataclass(frozen=True)
class Prompts:
    """The template of every step of :data:`~agents.steps.STEPS` and the Decoupler's two texts.

    ``templates`` maps each step to its template (what each step asks: docs/agents.md, "Prompts").
    ``answered_marker`` ends the ``decouple`` reply, followed by yes or no; ``no_notes`` is what
    ``{fine_print}`` holds before the first iteration.
    """

    templates: Mapping[str, str]
    answered_marker: str
    no_notes: str

    def __post_init__(self) -> None:
        for name, step in STEPS.items():
            used = placeholders(self.templates[name], name)
            if unknown := used - step.placeholders:
                raise ValueError(f"prompt {name!r} uses unknown placeholders {sorted(unknown)}; "
                                 f"allowed: {sorted(step.placeholders)}")
            if "question" not in used:
                raise ValueError(f"prompt {name!r} must contain {{question}}")
        if not self.answered_marker.strip():
            raise ValueError("prompts.answered_marker must not be empty")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Prompts:
        """The prompts of a config mapping; names the missing or unknown keys."""
        names = {*STEPS, *EXTRAS}
        if missing := names - set(config):
            raise ValueError(f"generator config 'prompts' lacks {sorted(missing)}")
        if unknown := set(config) - names:
            raise ValueError(f"generator config 'prompts' has unknown keys {sorted(unknown)}; expected {sorted(names)}")
        return cls({name: str(config[name]) for name in STEPS}, *(str(config[name]) for name in EXTRAS))

    def render(self, name: str, **values: Any) -> str:
        """The text of prompt ``name`` with its placeholders filled."""
        return self.templates[name].format(**values)


def placeholders(template: str, name: str) -> set[str]:
    """The field names ``template`` uses; a malformed template is an error naming the prompt."""
    try:
        return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:
        raise ValueError(f"prompt {name!r} is not a valid format string ({error})") from error


def build_request(pages: Sequence[Page], text: str, settings: GenerationSettings) -> LVLMRequest:
    """One user turn: the pages in ranked order (images, or text blocks ``"Page n:\n…"``), then the prompt text."""
    return LVLMRequest.user(*(page_content(page, n) for n, page in enumerate(pages, 1)), text, settings=settings)


def shown(pages: Sequence[Page], text: str) -> str:
    """The prompt as the trace records it: each page shown as ``<page:id>`` (image) or ``<text:id>``, then the
    text."""
    return "".join(page_marker(page) for page in pages) + text
