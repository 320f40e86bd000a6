"""Evaluating and reporting RAG runs: the per-query record types, the resumable trace, the rule metrics, the
LLM grader (the paper's "judge"), the reports and sweeps (``python -m hkrag.rag``) and the HTML page.

Generators (``agents/``, or any other) produce :class:`~hkrag.rag.records.QueryOutcome` records; nothing
here imports a generator (docs/evaluation.md).
"""
