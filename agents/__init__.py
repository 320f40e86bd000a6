"""The agentic generator (paper §3.3): Pruner, Judger, Decoupler, Summarizer, and the single-pass baseline.

``build_generator(config, backend)`` makes a :class:`Generator` from a ``conf/generator/*.yaml`` config;
``Generator.answer(query)`` returns a :class:`~hkrag.rag.records.QueryOutcome` with every LVLM call recorded.
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
