"""Corpus encoding into shards, FAISS indexes and retrieval evaluation."""
