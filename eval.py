"""Evaluate a retriever: ``python eval.py task=retrieval run_dir=... | model.base=... model.adapter=...``.

Encodes the corpora (resumable shards; data-parallel under ``accelerate launch``), searches single and
all pools with FAISS, and reports nDCG@5, recall@1/5/10 and MRR@10 as in the paper's Table 2.
All logic lives in :mod:`hkrag.tasks`.
"""

import hydra
from omegaconf import DictConfig

from hkrag.tasks import run_eval_task


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_eval_task(cfg, cfg.paths.output_dir)


if __name__ == "__main__":
    main()
