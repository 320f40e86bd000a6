"""Sharded corpus encoding: layout, resume after a crash, data-parallel ranks, validation."""

import numpy as np
import pytest
import torch

from hkrag.index.shards import (
    config_hash,
    encode_corpus,
    iter_multi_vector_shards,
    load_multi_vector_shards,
    load_shards,
    read_manifest,
)

DIM = 8
MANIFEST = {"model": "tiny-phi3v", "adapter": None, "config_hash": config_hash({"lr": 1e-4})}


def corpus(n=23):
    return [{"doc_id": f"doc{i:03d}", "seed": i} for i in range(n)]


def embed(rows, dim=DIM):
    """Deterministic per-row embeddings, independent of batching."""
    out = torch.stack([torch.randn(dim, generator=torch.Generator().manual_seed(r["seed"])) for r in rows])
    return torch.nn.functional.normalize(out, dim=-1)


class Crash(RuntimeError):
    pass


def crashing_after(batches, embed_fn=None):
    """An embedding function (``embed``, or ``embed_fn``) that raises after ``batches`` calls: a killed job."""
    calls = {"n": 0}

    def fn(rows):
        calls["n"] += 1
        if calls["n"] > batches:
            raise Crash("simulated kill")
        return (embed_fn or embed)(rows)

    return fn


def encode(items, out, **kw):
    kw = {"shard_size": 5, "manifest": MANIFEST, "batch_size": 2, "progress": False, **kw}
    return encode_corpus(items, kw.pop("embed_fn", embed), out, **kw)


def test_config_hash_is_stable_and_order_free():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_layout_manifest_and_round_trip(tmp_path):
    items = corpus()
    encode(items, tmp_path, dtype="float32")
    manifest = read_manifest(tmp_path)
    assert {k: manifest[k] for k in ("dim", "count", "shard_size", "num_shards")} == {
        "dim": DIM,
        "count": 23,
        "shard_size": 5,
        "num_shards": 5,
    }
    assert manifest["model"] == "tiny-phi3v" and manifest["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        f"shard-{s:05d}.{ext}" for s in range(5) for ext in ("json", "npy")
    ]
    assert not list(tmp_path.glob(".*tmp"))
    ids, vectors = load_shards(tmp_path)
    assert ids == [r["doc_id"] for r in items]
    np.testing.assert_array_equal(vectors, embed(items).numpy())


def test_float16_storage_loads_as_float32(tmp_path):
    encode(corpus(), tmp_path, dtype="float16")
    assert np.load(tmp_path / "shard-00000.npy").dtype == np.float16
    _, vectors = load_shards(tmp_path)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, embed(corpus()).numpy(), atol=1e-3)


def test_killed_job_resumes_to_the_same_index(tmp_path):
    items = corpus()
    encode(items, tmp_path / "clean")
    # 3 batches per shard of 5 rows (batch 2): 7 batches finish shards 0 and 1, then die inside shard 2.
    with pytest.raises(Crash):
        encode(items, tmp_path / "killed", embed_fn=crashing_after(7))
    assert sorted(p.name for p in (tmp_path / "killed").glob("shard-*.json")) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    with pytest.raises(FileNotFoundError, match="shard-00002"):
        load_shards(tmp_path / "killed")

    calls = []
    encode(items, tmp_path / "killed", embed_fn=lambda rows: calls.append(len(rows)) or embed(rows))
    assert sum(calls) == 23 - 10  # finished shards are not recomputed
    clean, resumed = load_shards(tmp_path / "clean"), load_shards(tmp_path / "killed")
    assert clean[0] == resumed[0]
    np.testing.assert_array_equal(clean[1], resumed[1])


def test_ranks_split_shards_without_overlap(tmp_path):
    items = corpus()
    seen = {}
    for rank in range(2):
        encode(
            items,
            tmp_path,
            rank=rank,
            world_size=2,
            embed_fn=lambda rows, r=rank: seen.setdefault(r, []).extend(x["doc_id"] for x in rows) or embed(rows),
        )
    assert set(seen[0]).isdisjoint(seen[1]) and len(seen[0]) + len(seen[1]) == 23
    assert seen[1][0] == "doc005"  # rank 1 starts at shard 1
    ids, vectors = load_shards(tmp_path)
    assert ids == [r["doc_id"] for r in items]
    np.testing.assert_allclose(vectors, embed(items).numpy(), atol=1e-3)


def test_one_rank_alone_leaves_the_other_shards_missing(tmp_path):
    encode(corpus(), tmp_path, rank=0, world_size=2)
    with pytest.raises(FileNotFoundError, match=r"2 of 5 shard\(s\) missing.*shard-00001, shard-00003"):
        load_shards(tmp_path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"manifest": {**MANIFEST, "model": "other"}}, "model"),
        ({"manifest": {**MANIFEST, "adapter": "lora-v2"}}, "adapter"),
        ({"manifest": {**MANIFEST, "config_hash": "abc"}}, "config_hash"),
        ({"dtype": "float32"}, "dtype"),
        ({"embed_fn": lambda rows: embed(rows, dim=DIM * 2)}, "dim"),
    ],
)
def test_restart_with_a_different_run_refuses_to_mix(tmp_path, change, field):
    items = corpus()
    with pytest.raises(Crash):
        encode(items, tmp_path, embed_fn=crashing_after(4))
    with pytest.raises(ValueError, match=rf"different run \({field}: on disk"):
        encode(items, tmp_path, **change)


def test_load_refuses_unexpected_model_or_dimension(tmp_path):
    encode(corpus(), tmp_path)
    assert len(load_shards(tmp_path, expect={"model": "tiny-phi3v", "dim": DIM})[0]) == 23
    with pytest.raises(ValueError, match="model: on disk 'tiny-phi3v' vs now 'big'"):
        load_shards(tmp_path, expect={"model": "big"})
    with pytest.raises(ValueError, match="dim: on disk 8 vs now 3072"):
        load_shards(tmp_path, expect={"dim": 3072})


def test_load_detects_corrupt_shard(tmp_path):
    encode(corpus(), tmp_path)
    np.save(tmp_path / "shard-00001.npy", np.zeros((5, DIM + 1), np.float16))
    with pytest.raises(
        ValueError, match=r"shard-00001: vectors \(5, 9\) float16 with 5 ids; manifest expects \(5, 8\)"
    ):
        load_shards(tmp_path)


def test_load_detects_shard_of_another_run(tmp_path):
    encode(corpus(), tmp_path / "a")
    encode(corpus(), tmp_path / "b", manifest={**MANIFEST, "model": "other"})
    for ext in ("npy", "json"):
        (tmp_path / "a" / f"shard-00002.{ext}").write_bytes((tmp_path / "b" / f"shard-00002.{ext}").read_bytes())
    with pytest.raises(ValueError, match="shard-00002 was written by a different run"):
        load_shards(tmp_path / "a")


def test_bad_embeddings_and_arguments_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="shard-00000: row 0 \\(page id 'doc000'\\) holds NaN or infinite values"):
        encode(corpus(), tmp_path / "nan", embed_fn=lambda rows: torch.full((len(rows), DIM), float("nan")))
    with pytest.raises(ValueError, match="returned shape"):
        encode(corpus(), tmp_path / "shape", embed_fn=lambda rows: torch.ones(len(rows) + 1, DIM))
    with pytest.raises(ValueError, match="manifest needs \\['config_hash'\\]"):
        encode(corpus(), tmp_path / "m", manifest={"model": "x"})
    with pytest.raises(ValueError, match="empty corpus"):
        encode([], tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_shards(tmp_path / "m")


def tokens(rows, dim=DIM):
    """Multi-vector embeddings: 1 + seed % 4 token vectors per row, deterministic per row."""
    return [embed([{"seed": 100 * r["seed"] + t} for t in range(1 + r["seed"] % 4)], dim) for r in rows]


def encode_tokens(items, out, **kw):
    return encode(items, out, **{"embed_fn": tokens, "multi_vector": True, **kw})


def test_multi_vector_shards_round_trip(tmp_path):
    items = corpus()
    encode_tokens(items, tmp_path, dtype="float16")
    assert read_manifest(tmp_path)["layout"] == "multi_vector"
    assert np.load(tmp_path / "shard-00000.npy").dtype == np.float16
    assert np.load(tmp_path / "shard-00000.offsets.npy").tolist() == [0, 1, 3, 6, 10, 11]  # 1, 2, 3, 4, 1 tokens
    ids, vectors, offsets = load_multi_vector_shards(tmp_path)
    assert ids == [r["doc_id"] for r in items] and vectors.dtype == np.float32 and offsets.dtype == np.int64
    expected = tokens(items)
    assert np.diff(offsets).tolist() == [len(t) for t in expected]
    np.testing.assert_allclose(vectors, torch.cat(expected).numpy(), atol=1e-3)
    shards = list(iter_multi_vector_shards(tmp_path))
    assert [len(shard_ids) for shard_ids, _, _ in shards] == [5, 5, 5, 5, 3]
    assert shards[1][1].shape == (shards[1][2][-1], DIM)  # each shard's offsets index its own vectors


def test_killed_multi_vector_job_resumes_to_the_same_index(tmp_path):
    items = corpus()
    encode_tokens(items, tmp_path / "clean")
    with pytest.raises(Crash):
        encode_tokens(items, tmp_path / "killed", embed_fn=crashing_after(7, tokens))
    with pytest.raises(FileNotFoundError, match="shard-00002"):
        load_multi_vector_shards(tmp_path / "killed")
    seen = []
    encode_tokens(items, tmp_path / "killed", embed_fn=lambda rows: seen.append(len(rows)) or tokens(rows))
    assert sum(seen) == 23 - 10
    clean, resumed = load_multi_vector_shards(tmp_path / "clean"), load_multi_vector_shards(tmp_path / "killed")
    for one, other in zip(clean, resumed, strict=True):
        np.testing.assert_array_equal(np.asarray(one), np.asarray(other))


def test_dense_and_multi_vector_shards_are_never_mixed(tmp_path):
    items = corpus()
    with pytest.raises(Crash):
        encode(items, tmp_path / "dense", embed_fn=crashing_after(4))
    with pytest.raises(ValueError, match=r"different run \(layout: on disk None vs now 'multi_vector'\)"):
        encode_tokens(items, tmp_path / "dense")
    with pytest.raises(Crash):
        encode_tokens(items, tmp_path / "multi", embed_fn=crashing_after(4, tokens))
    with pytest.raises(ValueError, match=r"different run \(layout: on disk 'multi_vector' vs now None\)"):
        encode(items, tmp_path / "multi")
    with pytest.raises(ValueError, match=r"different run \(dim: on disk 8 vs now 16\)"):
        encode_tokens(items, tmp_path / "multi", embed_fn=lambda rows: tokens(rows, dim=2 * DIM))
    encode_tokens(items, tmp_path / "multi")
    encode(items, tmp_path / "dense")
    with pytest.raises(ValueError, match="holds multi-vector embeddings, not the dense ones"):
        load_shards(tmp_path / "multi")
    with pytest.raises(ValueError, match="holds dense embeddings, not the multi-vector ones"):
        load_multi_vector_shards(tmp_path / "dense")
    with pytest.raises(ValueError, match="dim: on disk 8 vs now 128"):
        load_multi_vector_shards(tmp_path / "multi", expect={"dim": 128})


def test_two_jobs_started_together_into_one_folder_are_not_mixed(tmp_path):
    """A dense job and a multi-vector job both start into the same empty folder (no manifest yet to refuse them, as
    two Slurm array tasks with different model.head would): the dense one finishes its first shard while the other
    embeds, so the multi-vector job's write finds the dense manifest and refuses, naming the shard, leaving it
    unwritten; the folder stays the dense run's and loads."""
    items = corpus()

    def dense_job_meanwhile(rows):
        if not (tmp_path / "manifest.json").is_file():
            encode(items, tmp_path)
        return tokens(rows)

    with pytest.raises(ValueError, match=r"different run \(layout: on disk None vs now 'multi_vector'\); "
                                         rf"{tmp_path}/shard-00000 not written"):
        encode_tokens(items, tmp_path, embed_fn=dense_job_meanwhile)
    assert not list(tmp_path.glob("*.offsets.npy"))
    ids, vectors = load_shards(tmp_path)
    np.testing.assert_allclose(vectors, embed(items), atol=1e-3)


def test_multi_vector_shards_check_their_files(tmp_path):
    encode_tokens(corpus(), tmp_path)
    np.save(tmp_path / "shard-00001.offsets.npy", np.array([0, 2, 1, 3, 4, 5], dtype=np.int64))
    with pytest.raises(ValueError, match=r"shard-00001: vectors .* offsets \(6,\) int64 with 5 ids; manifest "
                                         r"expects 5 pages"):
        load_multi_vector_shards(tmp_path)
    with pytest.raises(ValueError, match="expected one \\(tokens >= 1, dim\\) array per row"):
        encode_tokens(corpus(), tmp_path / "bad", embed_fn=lambda rows: [torch.zeros(0, DIM) for _ in rows])
    with pytest.raises(ValueError, match="shard-00000: row 0 \\(page id 'doc000', token 0\\) holds NaN or infinite"):
        encode_tokens(corpus(), tmp_path / "nan", embed_fn=lambda rows: [torch.full((2, DIM), np.nan)] * len(rows))
