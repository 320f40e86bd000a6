"""Evaluating retrievers: the ranking metrics (trec_eval-exact nDCG, recall, MRR), the Table-2 evaluation
over single and all pools, and the Table-5 ablation aggregation (``python -m hkrag.retrieval.ablation``);
docs/index.md and docs/losses.md."""
