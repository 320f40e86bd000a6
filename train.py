"""Train the HKRAG retriever (or, with ``experiment=generator_*``, the generator): ``python train.py [experiment=...]``.

Runs as is on one CPU/GPU, and as ``accelerate launch [--config_file conf/accelerate/...] train.py ...``
on several GPUs (DDP or DeepSpeed). ``cfg.run`` names the task function (:mod:`hkrag.tasks.training` by
default, :mod:`hkrag.tasks.generator_training` for the generator); all logic lives there.
"""

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    instantiate(cfg.run)(cfg, cfg.paths.output_dir)


if __name__ == "__main__":
    main()
