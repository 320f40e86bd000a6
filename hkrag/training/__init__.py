"""Retriever training: losses live in hkrag.losses, the loop here."""
