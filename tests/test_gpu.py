"""Checks only a CUDA GPU can make: bf16, flash-attention, FAISS on GPU. Run with ``pytest -m gpu``."""

import importlib.util

import numpy as np
import pytest
import torch

from hkrag.retriever import Phi3VRetriever

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def embeddings(retriever: Phi3VRetriever, pages, dtype: torch.dtype) -> torch.Tensor:
    retriever.model.to("cuda", dtype=dtype)
    return retriever.encode_documents(pages)


def test_bf16_embeddings_track_fp32(pages):
    retriever = Phi3VRetriever.tiny(num_crops=4).eval()
    fp32 = embeddings(retriever, pages, torch.float32)
    bf16 = embeddings(retriever, pages, torch.bfloat16)
    assert torch.nn.functional.cosine_similarity(fp32, bf16).min() > 0.99


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attention_matches_sdpa(pages):
    retriever = Phi3VRetriever.tiny(num_crops=4).eval()
    sdpa = embeddings(retriever, pages, torch.bfloat16)
    retriever.model.set_attn_implementation("flash_attention_2")
    flash = retriever.encode_documents(pages)
    assert torch.nn.functional.cosine_similarity(sdpa, flash).min() > 0.999


def test_faiss_gpu_search_matches_cpu():
    pytest.importorskip("faiss", reason="FAISS is not installed")
    from hkrag.index.faiss_index import DocumentIndex, gpu_count

    if gpu_count() == 0:
        pytest.skip("FAISS has no GPU support here (install faiss-gpu)")
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((5000, 256)).astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    ids = [f"d{i}" for i in range(len(docs))]
    queries = docs[:50] + 0.01 * rng.standard_normal((50, 256)).astype(np.float32)
    gpu = DocumentIndex.build(ids, docs, "flat", use_gpu=True)
    cpu = DocumentIndex.build(ids, docs, "flat", use_gpu=False)
    assert gpu.on_gpu and not cpu.on_gpu
    assert gpu.search(queries, 10)[1] == cpu.search(queries, 10)[1]
