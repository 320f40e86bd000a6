"""The agentic generator (paper §3.3): Pruner, Judger, Decoupler, Summarizer, and the single-pass baseline.

``build_generator(config, backend)`` makes a :class:`Generator` from a ``conf/generator/*.yaml`` config;
``Generator.answer(query)`` returns a :class:`~hkrag.rag.records.QueryOutcome` with every LVLM call recorded.

The layer rule (README "Layout", tested by ``tests/test_layers.py``): ``agents/`` is the paper's method built
on the library, and it imports only ``hkrag.lvlm`` (the backend interface) and ``hkrag.rag.records`` (the RAG
record types). ``hkrag`` names ``agents`` only at the composition root, ``hkrag/tasks/rag.py`` (or through a
config's ``_target_``), so a second generator, e.g. a ViDoRAG-style baseline, can sit beside ``agents/``
without touching ``hkrag``. See docs/agents.md.
"""

from hkrag.rag.records import CallRecord, Query, QueryOutcome

from .pipeline import AgenticGenerator, Generator, GeneratorConfig, SinglePassGenerator, build_generator

__all__ = [
    "AgenticGenerator",
    "CallRecord",
    "Generator",
    "GeneratorConfig",
    "Query",
    "QueryOutcome",
    "SinglePassGenerator",
    "build_generator",
]
