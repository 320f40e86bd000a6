"""The agentic generator (paper section 3.3): pruner, judger, decoupler, summarizer."""
