"""HKRAG: holistic knowledge RAG over visually-rich documents."""
