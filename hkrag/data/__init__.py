"""Data: OpenDocVQA loaders, the built-in synthetic corpus, PDF ingestion, collators."""
