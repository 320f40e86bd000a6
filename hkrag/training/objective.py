"""The objective a run trains: the ``loss`` group of the config as a loss module, for the model's head."""

from __future__ import annotations

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hkrag.late_interaction import LateInteractionLoss
from hkrag.losses import HybridMaskLoss, PretrainingLoss
from hkrag.retriever import HeadSettings


def make_loss(loss_cfg: DictConfig, head: HeadSettings | None = None) -> HybridMaskLoss | PretrainingLoss:
    """The ``loss`` group's objective: its ``_target_`` (``hkrag.losses.PretrainingLoss``, conf/loss/pretrain.yaml),
    else :class:`HybridMaskLoss` with its values, over MaxSim (:class:`LateInteractionLoss`) under the
    late-interaction head. ``loss.pairwise`` (colpali-engine's pairwise loss) needs that head."""
    late = head is not None and head.late_interaction
    if "_target_" in loss_cfg:
        if late:
            raise ValueError(f"model.head=late_interaction trains with the contrastive losses (loss=infonce, hkrag, "
                             f"...), not {loss_cfg._target_}")
        return instantiate(loss_cfg)
    settings = OmegaConf.to_container(loss_cfg, resolve=True)
    if late:
        return LateInteractionLoss(**settings)
    settings.pop("pairwise_tau", None)
    if settings.pop("pairwise", False):
        raise ValueError("loss.pairwise=true is colpali-engine's pairwise loss over MaxSim: it needs "
                         "model.head=late_interaction")
    return HybridMaskLoss(**settings)
