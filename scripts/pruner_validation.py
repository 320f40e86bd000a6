"""The validation split's runs of the Pruner's P(yes) and of the Pruner as a reranker, for a shipped generator.

    PYTHONPATH=. python scripts/pruner_validation.py --out outputs/pruner_val   # CPU: about 50 min on 2 shared cores
    PYTHONPATH=. python scripts/pruner_validation.py --out outputs/pruner_val --no-rerank   # the run folder only

The validation questions are the agents generator's held-out ones (``generator_training.validation``: fraction
0.1, seed 0 of ``experiment=generator_agents_tiny``; 108 questions on 11 training documents that no training
example showed). Two things are written into ``--out``:

- ``run/``: a generator run folder that ``python -m hkrag.tasks.agent_steps`` reads, made from the shipped weights
  (``base`` and ``checkpoints/final/adapter`` linked, the experiment's config, ``report.json`` naming the
  validation questions, and the reader's top 3 over the training pages as the training run built them);
- ``rerank/``: the shipped reader's top 10 over the 960 training pages reordered by the generator's P(yes)
  (``retriever=rerank``, as ``eval.py`` builds it), its ``rerank.json`` for ``python -m hkrag.retrieval.rerank_report``
  and ``validation_queries.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from hkrag.cli import existing
from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.data.splits import ValidationSplit
from hkrag.io import write_json, write_text
from hkrag.retrieval.evaluation import RetrievalEvalConfig, evaluate_ranker
from hkrag.retrieval.generator_pairs import build_generator_pairs
from hkrag.tasks.agent_steps import RETRIEVED_PAIRS
from hkrag.tasks.common import BASE_DIR, CONF_DIR, FINAL_ADAPTER, prepare_data
from hkrag.tasks.generator_training import training_retriever
from hkrag.tasks.rag import page_scorer, question_text
from hkrag.tasks.rankers import VisualModel, bind_ranker
from hkrag.tasks.retrieval import RERANK_FILE

EXPERIMENT = "generator_agents_tiny"


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides)


def validation_queries(cfg) -> list:
    """The held-out questions of the experiment's validation split."""
    qa = load_qa(cfg.data.qa_source, cfg.data.train.qa_config, cfg.data.train.split)
    return ValidationSplit(**cfg.generator_training.validation).split(qa)[1]


def link_to(link: Path, target: Path) -> None:
    """``link`` pointing at ``target``, replacing a link to anything else (a second run over the same ``--out``)."""
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    if link.is_symlink():
        link.unlink()
    os.symlink(target, link)


def make_run(weights: Path, run: Path) -> list:
    """A run folder of the shipped generator ``weights`` that ``hkrag.tasks.agent_steps`` reads; its questions."""
    cfg = compose_config("train", [f"experiment={EXPERIMENT}"])
    prepare_data(cfg.data)
    queries = validation_queries(cfg)
    (run / FINAL_ADAPTER).parent.mkdir(parents=True, exist_ok=True)
    for link, target in ((run / BASE_DIR, weights / BASE_DIR), (run / FINAL_ADAPTER, weights / FINAL_ADAPTER)):
        link_to(link, target.resolve())
    write_text(run / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg))
    write_json(run / "report.json", {"validation_queries": [ex.query_id for ex in queries],
                                     "made_from": str(weights)})
    gen = cfg.generator_training
    corpus = load_corpus(cfg.data.corpus_source, cfg.data.train.corpus_config, cfg.data.train.split)
    build_generator_pairs(run / RETRIEVED_PAIRS, queries, corpus, "retrieved", cfg.generator.top_k, question_text,
                          retriever=lambda: training_retriever(gen.retriever)[0],
                          identity=training_retriever(gen.retriever)[1])
    return queries


def rerank(queries: list, out: Path, depth: int, weights: Path) -> None:
    """The reader's top ``depth`` over the training pages reordered by the P(yes) of the generator ``weights``
    (served as ``lvlm=phi3v`` with its base and adapter, whatever ``eval.py``'s default generator), for ``queries``."""
    cfg = compose_config("eval", ["retriever=rerank", "run_dir=weights/reader_tiny", f"retriever.depth={depth}",
                                  "lvlm=phi3v_agents_tiny", f"lvlm.base={weights / BASE_DIR}",
                                  f"lvlm.adapter={weights / FINAL_ADAPTER}"])
    train = cfg.data.train
    settings = RetrievalEvalConfig(qa_source=cfg.data.qa_source, corpus_source=cfg.data.corpus_source,
                                   datasets=[train.qa_config], split=train.split, pools=["single"],
                                   top_k=cfg.eval.top_k)
    ids = {ex.query_id for ex in queries}
    scorer, backend = page_scorer(cfg)
    try:
        ranker = bind_ranker(instantiate(cfg.retriever), VisualModel(cfg, "cpu"), settings, out, scorer)
        evaluate_ranker(ranker, settings, out,
                        load_qa_fn=lambda *args: [ex for ex in load_qa(*args) if ex.query_id in ids])
    finally:
        backend.close()
    write_json(out / RERANK_FILE, {**ranker.cost, **ranker.per_query_cost(), "queries": ranker.trace})
    write_json(out / "validation_queries.json", sorted(ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=existing("dir", (BASE_DIR, FINAL_ADAPTER), "a shipped generator"),
                        default=f"weights/{EXPERIMENT}", help="a shipped generator (default %(default)s; a relative "
                        "path is also looked for in the repository)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--no-rerank", action="store_true", help="only the run folder (the Pruner's AUROC), not the "
                        "reranker's run (most of the time)")
    args = parser.parse_args()
    queries = make_run(args.weights, args.out / "run")
    if not args.no_rerank:
        rerank(queries, args.out / "rerank", args.depth, args.weights)


if __name__ == "__main__":
    main()
