"""Hard-negative mining (hkrag/index/mine.py) and training with the mined negatives (trainer.hard_negatives)."""

import json

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.data.pairs import read_hard_negatives, training_pairs, with_hard_negatives
from hkrag.data.synthetic import SyntheticConfig, generate
from hkrag.index.mine import main, mine_from_embeddings, mine_negatives
from hkrag.index.shards import encode_corpus
from hkrag.losses import HybridMaskLoss
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig

# q1's ranking: a .9 (its positive), t .8 (a test page), b .7 and c .7 (tie: b first), e .1
RUN = {"q1": {"a": 0.9, "t": 0.8, "b": 0.7, "c": 0.7, "e": 0.1}, "q2": {"e": 0.9, "c": 0.5, "a": 0.4}}
POSITIVES = {"q1": {"a"}, "q2": {"e"}}
TRAINING_PAGES = {"a", "b", "c", "e"}


def test_mining_skips_positives_and_pages_outside_the_training_corpus():
    assert mine_negatives(RUN, POSITIVES, keep=2, allowed=TRAINING_PAGES) == {"q1": ["b", "c"], "q2": ["c", "a"]}
    assert mine_negatives(RUN, POSITIVES, keep=2) == {"q1": ["t", "b"], "q2": ["c", "a"]}  # no split given


def test_mining_skips_the_first_ranks_and_keeps_at_most_keep():
    assert mine_negatives(RUN, POSITIVES, keep=2, skip=3, allowed=TRAINING_PAGES) == {"q1": ["c", "e"], "q2": []}
    assert mine_negatives(RUN, POSITIVES, keep=1, skip=1) == {"q1": ["t"], "q2": ["c"]}


def test_mining_is_deterministic_whatever_the_order_of_the_run():
    shuffled = {query: dict(reversed(list(scores.items()))) for query, scores in reversed(list(RUN.items()))}
    assert mine_negatives(shuffled, POSITIVES, keep=3) == mine_negatives(RUN, POSITIVES, keep=3)
    assert list(mine_negatives(shuffled, POSITIVES, keep=3)) == ["q1", "q2"]


def test_mining_refuses_unjudged_queries_and_bad_counts():
    with pytest.raises(ValueError, match=r"1 queries of the run have no relevance judgements \(e.g. \['q2'\]\)"):
        mine_negatives(RUN, {"q1": {"a"}}, keep=1)
    with pytest.raises(ValueError, match="keep=0"):
        mine_negatives(RUN, POSITIVES, keep=0)


MANIFEST = {"model": "hand", "config_hash": "h", "weights": "w0"}


def write_shards(directory, ids, vectors, id_key="doc_id", manifest=MANIFEST):
    rows = [{id_key: i, "vector": np.asarray(v, dtype=np.float32)} for i, v in zip(ids, vectors)]
    encode_corpus(rows, lambda batch: np.stack([r["vector"] for r in batch]), directory, shard_size=2,
                  manifest=manifest, dtype="float32", id_key=id_key, progress=False)


@pytest.fixture
def embeddings(tmp_path):
    write_shards(tmp_path / "queries", ["q1", "q2"], [[1.0, 0.0], [0.0, 1.0]], id_key="query_id")
    pages = {"a": [1.0, 0.0], "b": [0.8, 0.6], "c": [0.6, 0.8], "e": [0.0, 1.0], "t": [0.96, 0.28]}
    write_shards(tmp_path / "corpus", list(pages), list(pages.values()))
    qrels = tmp_path / "qrels.json"
    qrels.write_text(json.dumps({"q1": {"a": 1}, "q2": {"e": 1}}))
    return tmp_path


def test_mining_from_embedding_shards(embeddings):
    qrels = json.loads((embeddings / "qrels.json").read_text())
    negatives = mine_from_embeddings(embeddings / "queries", embeddings / "corpus", qrels, depth=5, keep=2,
                                     allowed=TRAINING_PAGES)
    assert negatives == {"q1": ["b", "c"], "q2": ["c", "b"]}
    write_shards(embeddings / "other", ["a"], [[1.0, 0.0]], manifest={**MANIFEST, "weights": "w1"})
    with pytest.raises(ValueError, match="different run"):
        mine_from_embeddings(embeddings / "queries", embeddings / "other", qrels, depth=5, keep=1)


def test_cli_writes_the_file_the_pair_builder_reads(embeddings):
    out = main(["--queries", str(embeddings / "queries"), "--corpus", str(embeddings / "corpus"),
                "--qrels", str(embeddings / "qrels.json"), "--out", str(embeddings / "negatives.json"),
                "--depth", "5", "--skip", "1", "--keep", "3"])
    # q1 ranks a, t, b, c, e and q2 e, c, b, t, a: rank 1 (each one's positive) skipped, then three kept
    assert read_hard_negatives(out) == {"q1": ("t", "b", "c"), "q2": ("c", "b", "t")}
    assert json.loads(out.read_text())["settings"]["skip"] == 1


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    generate(root, SyntheticConfig(n_train=16, n_test=4, train_groups_per_style=1, test_groups_per_style=1,
                                   group_size=2))
    corpus = load_corpus(root / "corpus", "default", "train")
    return training_pairs(load_qa(root / "qa", "default", "train"), corpus), corpus, root


def next_positive_negatives(pairs):
    """Each query's negative: the next query's page (so it is also another row's positive in the batch)."""
    return {p.query_id: [q.positives[0]] for p, q in zip(pairs, pairs[1:] + pairs[:1]) if q.positives[0]
            not in p.positives}


def test_pair_builder_checks_the_mined_negatives(synthetic):
    pairs, corpus, root = synthetic
    negatives = next_positive_negatives(pairs)
    attached = with_hard_negatives([p for p in pairs if p.query_id in negatives], negatives, 1, corpus)
    assert all(len(p.negatives) == 1 and p.negatives[0] not in p.positives for p in attached)
    first = pairs[0]
    test_page = load_corpus(root / "corpus", "synchart", "test").doc_ids[0]
    with pytest.raises(ValueError, match=f"hard negative {test_page} of query {first.query_id} is not a page of"):
        with_hard_negatives([first], {first.query_id: [test_page]}, 1, corpus)
    with pytest.raises(ValueError, match="is one of its positives"):
        with_hard_negatives([first], {first.query_id: [first.positives[0]]}, 1, corpus)
    with pytest.raises(ValueError, match=f"query {first.query_id} has 1 mined hard negatives, 2 are needed"):
        with_hard_negatives([first], {first.query_id: [pairs[1].positives[0]]}, 2, corpus)


class Recording(HybridMaskLoss):
    def forward(self, q, d, generator=None, ignore=None):
        self.seen = (q.detach(), d.detach(), ignore)
        return super().forward(q, d, generator, ignore)


@pytest.mark.parametrize("chunk_size", [None, 4], ids=["whole", "gradient-cached"])
def test_training_batches_hold_the_negatives_after_the_positives(synthetic, tmp_path, chunk_size):
    pairs, corpus, _ = synthetic
    negatives = next_positive_negatives(pairs)
    pairs = [p for p in pairs if p.query_id in negatives]
    path = tmp_path / "negatives.json"
    path.write_text(json.dumps({"negatives": negatives}))
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, dropout=0.0), num_crops=4, seed=0)
    config = TrainerConfig(global_batch_size=len(pairs), chunk_size=chunk_size, max_steps=1, lr=1e-3, seed=3,
                           hard_negatives=1, negatives_file=str(path))
    loss_fn = Recording(tau=0.1)
    trainer = RetrieverTrainer(retriever, loss_fn, pairs, corpus, config, Accelerator(cpu=True), tmp_path,
                               RunLogger(tmp_path))
    rows = [trainer.pairs[i] for i in trainer.sampler.global_batch(0, 0)]
    trainer.fit()
    q, d, ignore = loss_fn.seen
    batch = len(rows)
    assert q.shape[0] == batch and d.shape[0] == 2 * batch and ignore.shape == (batch, 2 * batch)
    pages = [r.positives[0] for r in rows] + [r.negatives[0] for r in rows]
    expected = torch.tensor([[page in r.positives and i != j for j, page in enumerate(pages)]
                             for i, r in enumerate(rows)])
    assert torch.equal(ignore, expected) and ignore[:, batch:].any()  # a negative that is another row's positive
    # document row B + i embeds row i's negative: the same vector as that page's row among the positives
    where = {page: j for j, page in enumerate(pages[:batch])}
    for i, row in enumerate(rows):
        assert torch.allclose(d[batch + i], d[where[row.negatives[0]]], atol=1e-5)


def test_hard_negatives_need_a_file_and_the_contrastive_loss(synthetic, tmp_path):
    pairs, corpus, _ = synthetic
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4), num_crops=4, seed=0)
    config = TrainerConfig(global_batch_size=4, max_steps=1, hard_negatives=2)
    with pytest.raises(ValueError, match="trainer.hard_negatives=2 needs trainer.negatives_file"):
        RetrieverTrainer(retriever, HybridMaskLoss(), pairs, corpus, config, Accelerator(cpu=True), tmp_path)
