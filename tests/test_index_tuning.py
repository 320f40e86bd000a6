"""Factory specs, the refine stage, search-parameter tuning and its persistence (small n)."""

import re

import faiss
import numpy as np
import pytest

from hkrag.index.faiss_index import DocumentIndex
from hkrag.index.shards import encode_corpus
from hkrag.index.spec import IndexSpec, search_space
from hkrag.index.synthetic_embeddings import (
    QUERY_STREAM,
    TUNING_STREAM,
    EmbeddingLike,
    IsotropicMixture,
    embedding_stats,
)
from hkrag.index.tuning import (
    exact_neighbours,
    format_held_out,
    held_out_recall,
    main,
    recall_at_k,
    recall_lower_bound,
    select,
    tune,
)

K = 5
SPEC = "faiss:PCA32,IVF16,PQ8x4fs,Refine(SQ8)"


@pytest.fixture(scope="module")
def corpus():
    data = EmbeddingLike(dim=64, rank=16, topics=30, seed=1)
    docs = np.vstack([chunk for _, chunk in data.chunks(4000, 1000)])
    return [f"d{i}" for i in range(len(docs))], docs, data


@pytest.fixture(scope="module")
def tuned(corpus):
    ids, docs, data = corpus
    queries = data.sample(150, stream=TUNING_STREAM)
    index = DocumentIndex.build(ids, docs, SPEC, use_gpu=False)
    record = tune(index, queries, exact_neighbours(queries, [docs], K)[1], target=0.9, repeats=1)
    return index, record


def test_factory_spec_parses_and_round_trips():
    spec = IndexSpec.parse("faiss: PCA32,IVF16,PQ8x4fs,Refine(SQ8) ; nprobe=4,k_factor_rf=8")
    assert (spec.kind, spec.params) == ("faiss", "nprobe=4,k_factor_rf=8")
    assert spec.factory == "PCA32,IVF16,PQ8x4fs,Refine(SQ8)"
    assert IndexSpec.parse(str(spec)) == spec and spec.factory_string() == spec.factory
    assert IndexSpec.parse("faiss:IVF4096,Flat").default_max_train() == 40 * 4096
    with pytest.raises(ValueError, match="expected faiss:<index_factory string>"):
        IndexSpec.parse("faiss: ;nprobe=2")
    with pytest.raises(ValueError, match="apply to faiss: specs only"):
        IndexSpec(kind="sq8", params="nprobe=2")


def test_bad_factory_or_parameter_is_named(corpus):
    ids, docs, _ = corpus
    with pytest.raises(ValueError, match="FAISS cannot build faiss:NoSuchIndex7"):
        DocumentIndex(64, "faiss:NoSuchIndex7")
    with pytest.raises(ValueError, match="cannot set search parameters 'bogus=3' on IVF4,Flat"):
        DocumentIndex.build(ids[:500], docs[:500], "faiss:IVF4,Flat;bogus=3", use_gpu=False)
    with pytest.raises(ValueError, match="search parameters apply to faiss: specs only, not flat"):
        DocumentIndex.build(ids[:10], docs[:10]).search_params = "nprobe=2"
    with pytest.raises(ValueError, match="Flat has no search parameters to tune"):
        tune(DocumentIndex.build(ids[:10], docs[:10], "faiss:Flat"), docs[:3], np.zeros((3, K), np.int64))


def test_chunked_exact_search_matches_brute_force(corpus):
    _, docs, data = corpus
    queries = data.sample(20, stream=QUERY_STREAM)
    scores, rows = exact_neighbours(queries, (docs[i : i + 700] for i in range(0, len(docs), 700)), K)
    expected = np.argsort(-(queries @ docs.T), axis=1)[:, :K]
    np.testing.assert_array_equal(rows, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ docs.T, expected, axis=1), rtol=1e-5)
    assert recall_at_k(rows, expected) == 1.0
    assert recall_at_k(np.c_[rows[:, :4], np.full(20, -1)], expected) == pytest.approx(0.8)


def test_refine_returns_exact_top_k_when_candidates_contain_it(corpus):
    ids, docs, data = corpus
    index = DocumentIndex.build(ids, docs, "faiss:IVF16,PQ16x4fs,RFlat;nprobe=4,k_factor_rf=8", use_gpu=False)
    queries = data.sample(100, stream=QUERY_STREAM)
    _, candidates = faiss.downcast_index(index.faiss_index).base_index.search(queries, 8 * K)
    scores = queries @ docs.T
    exact = np.argsort(-scores, axis=1)[:, :K]
    found_scores, found = index.search_arrays(queries, K)
    contained = np.array([set(e) <= set(c) for e, c in zip(exact, candidates, strict=True)])
    assert 0 < contained.sum() < len(queries), "the case needs queries of both kinds"
    # Near duplicates tie to 1e-7, so the order of equal scores may differ: compare sets and scores.
    assert all(set(f) == set(e) for f, e in zip(found[contained], exact[contained], strict=True))
    np.testing.assert_allclose(found_scores[contained], np.take_along_axis(scores, exact, 1)[contained], rtol=1e-5)
    assert not any(set(f) == set(e) for f, e in zip(found[~contained], exact[~contained], strict=True))


def test_tuned_index_meets_its_target_on_held_out_queries(corpus, tuned):
    ids, docs, data = corpus
    index, record = tuned
    assert record["met"] and record["recall"] >= 0.9 and index.search_params == record["params"]
    assert {"nprobe", "k_factor_rf"} == {p.split("=")[0] for p in record["params"].split(",")}
    assert any(m["recall"] < 0.9 for m in record["measured"]), "a target every setting meets tests nothing"
    held_out = data.sample(300, stream=QUERY_STREAM)
    _, rows = index.search_arrays(held_out, K)
    # 300 queries x 5 slots: a tolerance of 0.03 is about four standard errors of the recall estimate.
    assert recall_at_k(rows, exact_neighbours(held_out, [docs], K)[1]) >= 0.9 - 0.03


def test_tuned_parameters_persist_and_reload(corpus, tuned, tmp_path):
    ids, docs, data = corpus
    index, record = tuned
    loaded = DocumentIndex.load(index.save(tmp_path / "index"), use_gpu=False)
    assert loaded.spec == index.spec and loaded.search_params == record["params"] and loaded.tuning == record
    queries = data.sample(30, stream=QUERY_STREAM)
    np.testing.assert_array_equal(loaded.search_arrays(queries, K)[1], index.search_arrays(queries, K)[1])
    nprobe = int(dict(p.split("=") for p in record["params"].split(","))["nprobe"])
    assert faiss.extract_index_ivf(loaded.faiss_index).nprobe == nprobe
    rebuilt = DocumentIndex.build(ids[:1000], docs[:1000], f"tuned:{tmp_path / 'index'}", use_gpu=False)
    assert rebuilt.spec == index.spec and faiss.extract_index_ivf(rebuilt.faiss_index).nprobe == nprobe
    with pytest.raises(FileNotFoundError, match="no saved index at"):
        IndexSpec.parse(f"tuned:{tmp_path / 'missing'}")


def _cli_args(corpus, tmp_path) -> list[str]:
    """Shards of the corpus, 100 tuning and 100 test queries under tmp_path; the CLI arguments naming them."""
    ids, docs, data = corpus
    queries, test = data.sample(100, stream=TUNING_STREAM), data.sample(100, stream=QUERY_STREAM)
    for name, rows, vectors, key in (("docs", ids, docs, "doc_id"), ("queries", range(100), queries, "query_id"),
                                     ("test", range(100), test, "query_id")):
        encode_corpus([{key: str(r)} for r in rows], lambda batch, v=vectors, k=key: v[[
            int(str(b[k]).lstrip("d")) for b in batch]], tmp_path / name, shard_size=1000,
            manifest={"model": "m", "config_hash": "h"}, dtype="float32", id_key=key, progress=False)
    return ["--index", str(tmp_path / "ix"), "--shards", str(tmp_path / "docs"), "--queries",
            str(tmp_path / "queries"), "--target", "0.9", "--cpu"]


def _assert_held_out_printed(out: str) -> None:
    held_out = re.search(r"held-out test recall@5: ([\d.]+) \[([\d.]+), ([\d.]+)\] \(95 % bootstrap interval, "
                         r"100 test queries\)", out)
    assert held_out and float(held_out[2]) <= float(held_out[1]) <= float(held_out[3])


def test_cli_builds_tunes_and_writes_parameters(corpus, tmp_path, capsys):
    args = _cli_args(corpus, tmp_path)
    main([*args, "--spec", SPEC, "--test-queries", str(tmp_path / "test")])
    first = DocumentIndex.load(tmp_path / "ix", use_gpu=False)
    assert first.tuning["met"] and first.search_params == first.tuning["params"]
    out = capsys.readouterr().out
    assert "on the tuning queries (target 0.9 for their normal lower bound" in out and "optimistic" in out
    _assert_held_out_printed(out)
    main([*args, "--mmap"])  # re-tune the saved index in place, its stored vectors mapped: only index.json changes
    assert DocumentIndex.load(tmp_path / "ix", use_gpu=False).tuning["target"] == 0.9
    assert "recall@5" in capsys.readouterr().out
    main([*args, "--select", "IVF16,SQ8", "HNSW16,SQ8", "--cost", "distances_per_query"])
    assert "selected faiss:" in capsys.readouterr().out
    assert DocumentIndex.load(tmp_path / "ix", use_gpu=False).spec.factory in ("IVF16,SQ8", "HNSW16,SQ8")


def test_cli_select_reports_held_out_test_recall(corpus, tmp_path, capsys):
    """--select with --test-queries measures the selected index on them (it used to return before doing so)."""
    main([*_cli_args(corpus, tmp_path), "--select", "IVF16,SQ8", "--test-queries", str(tmp_path / "test")])
    out = capsys.readouterr().out
    assert "selected faiss:IVF16,SQ8" in out
    _assert_held_out_printed(out)


def test_embedding_like_generator_has_the_measured_structure():
    data = EmbeddingLike(dim=256, rank=16, topics=40, duplicates=0.3, seed=3)
    a = data.sample(600, stream=5)
    np.testing.assert_array_equal(a, EmbeddingLike(data.settings).sample(600, stream=5))
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, rtol=1e-5)
    stats = embedding_stats(a)
    isotropic = embedding_stats(IsotropicMixture(256, clusters=40, seed=3).sample(600, stream=5))
    assert stats["dims_90"] < 0.15 < isotropic["dims_90"]  # 16 latent directions hold the signal
    assert stats["mean_cos"] > 0.3 > abs(isotropic["mean_cos"])  # the shared mean direction
    no_copies = embedding_stats(EmbeddingLike(dim=256, rank=16, topics=40, duplicates=0, seed=3).sample(600, 5))
    assert stats["near_duplicates"] > no_copies["near_duplicates"] + 0.15 and isotropic["near_duplicates"] == 0
    with pytest.raises(ValueError, match="rank must be in"):
        EmbeddingLike(dim=8, rank=9)


def test_held_out_recall_has_a_two_sided_bootstrap_interval():
    """Half the queries at recall 1, half at 0: mean .5, standard error .05, so the 95 % percentile bootstrap
    interval is close to .5 ± 1.96 · .05; a constant recall has a point interval."""
    record = held_out_recall(np.array([0.0, 1.0] * 50))
    assert record["recall"] == 0.5 and record["queries"] == 100
    assert record["recall_low"] == pytest.approx(0.5 - 1.96 * 0.05, abs=0.015)
    assert record["recall_high"] == pytest.approx(0.5 + 1.96 * 0.05, abs=0.015)
    assert held_out_recall(np.ones(7)) == {"recall": 1.0, "recall_low": 1.0, "recall_high": 1.0, "queries": 7}
    assert format_held_out({"recall": 0.9642, "recall_low": 0.955, "recall_high": 0.9721, "queries": 1000}) == (
        "0.964 [0.955, 0.972] (95 % bootstrap interval, 1000 test queries)")


def test_recall_lower_bound_is_the_one_sided_normal_bound():
    recalls = np.array([1.0, 0.8, 1.0, 0.6])  # mean 0.85, sample std 0.19149
    assert recall_lower_bound(recalls, 0.5) == pytest.approx(0.85)
    assert recall_lower_bound(recalls, 0.95) == pytest.approx(0.85 - 1.644854 * 0.191485 / 2, abs=1e-5)
    assert recall_lower_bound(np.ones(3), 0.99) == 1.0
    with pytest.raises(ValueError, match="confidence must be in"):
        recall_lower_bound(recalls, 1.0)


def test_tuning_asks_the_lower_bound_to_reach_the_target(tuned):
    index, record = tuned
    assert record["confidence"] == 0.95 and record["recall_lower"] >= record["target"]
    cheaper = [m for m in record["measured"] if m["ms_per_query"] < record["ms_per_query"]]
    assert all(m["recall_lower"] < record["target"] for m in cheaper)
    assert all(m["recall_lower"] <= m["recall"] for m in record["measured"])


def _clustered(topics: int, spread: float, n: int = 20000, dim: int = 32):
    data = EmbeddingLike(dim=dim, rank=dim, topics=topics, topic_spread=spread, duplicates=0, seed=1)
    docs = np.vstack([chunk for _, chunk in data.chunks(n, 10000)])
    queries = data.sample(200, stream=TUNING_STREAM)
    return [str(i) for i in range(n)], docs, queries, exact_neighbours(queries, [docs], K)[1]


def test_search_space_holds_inverted_lists_and_graphs():
    assert search_space(20000, 32) == ["IVF512,SQ8", "HNSW32,SQ8"]
    assert search_space(10**6, 768, prefix="PCA256,", suffix=",Refine(SQfp16)") == [
        "PCA256,IVF4096,SQ8,Refine(SQfp16)", "PCA256,HNSW32,SQ8,Refine(SQfp16)",
        "PCA256,IVF16384_HNSW32,SQ8,Refine(SQfp16)"]


def test_tuner_picks_a_graph_index_on_weakly_clustered_data():
    """Weakly clustered (a topic per vector, wide spread): IVF must probe many lists, a graph walks few nodes.
    Cost is FAISS's count of distances per query, so the choice does not hang on a shared machine's timing."""
    faiss.omp_set_num_threads(1)  # a graph built by one thread is deterministic
    weak = _clustered(topics=20000, spread=1.5)
    index, records = select(*weak, search_space(20000, 32, codes="Flat"), target=0.9, cost="distances_per_query",
                            repeats=1)
    ivf, graph = records
    assert index.spec.factory == "HNSW32,Flat" and graph["eligible"]
    assert graph["distances_per_query"] * 2 < ivf["distances_per_query"]  # 669 vs 2675 measured
    strong_ivf = select(*_clustered(topics=30, spread=0.2), ["IVF512,Flat"], target=0.9,
                        cost="distances_per_query", repeats=1)[1][0]
    assert strong_ivf["distances_per_query"] * 4 < ivf["distances_per_query"]  # nprobe 8 vs 64 measured
    # A memory budget rules the graph out (its links cost more than the float32 vectors at dim 32).
    index, records = select(*weak, search_space(20000, 32, codes="Flat"), target=0.9, max_ram=2.0,
                            cost="distances_per_query", repeats=1)
    assert index.spec.factory == "IVF512,Flat" and not records[1]["eligible"] and records[1]["ram_fraction"] > 2
    with pytest.raises(ValueError, match="no spec reaches recall@5 0.9 .* within 0.5 of flat's memory"):
        select(*weak, ["IVF512,Flat"], target=0.9, max_ram=0.5, repeats=1)
    with pytest.raises(ValueError, match="cost must be one of"):
        select(*weak, ["IVF512,Flat"], cost="seconds")


def test_only_combinations_meeting_the_target_are_timed_again(corpus, monkeypatch):
    """Repeated timing goes to the combinations whose recall bound meets the target; the others get one search."""
    import hkrag.index.tuning as tuning

    ids, docs, data = corpus
    queries = data.sample(100, stream=TUNING_STREAM)
    exact = exact_neighbours(queries, [docs], K)[1]
    index = DocumentIndex.build(ids, docs, "faiss:IVF16,Flat", use_gpu=False)
    calls = []
    real = tuning._timed_search
    monkeypatch.setattr(tuning, "_timed_search", lambda *a: calls.append(a[3]) or real(*a))
    record = tune(index, queries, exact, target=0.9, repeats=3)
    meeting = sum(m["recall_lower"] >= 0.9 for m in record["measured"])
    assert 0 < meeting < len(record["measured"])  # nprobe 1 misses, nprobe 16 (exhaustive) meets
    assert calls.count(1) == len(record["measured"]) and calls.count(2) == meeting
