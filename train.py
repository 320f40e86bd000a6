"""Train the HKRAG retriever: ``python train.py [experiment=...] [key=value ...]``.

Runs as is on one CPU/GPU, and as ``accelerate launch [--config_file conf/accelerate/...] train.py ...``
on several GPUs (DDP or DeepSpeed). All logic lives in :mod:`hkrag.tasks.training`.
"""

import hydra
from omegaconf import DictConfig

from hkrag.tasks.training import run_training


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_training(cfg, cfg.paths.output_dir)


if __name__ == "__main__":
    main()
