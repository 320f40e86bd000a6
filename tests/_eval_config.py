"""``eval.py``'s config composed on a tiny built-in corpus (two data sets, three-page groups, the tiny model),
shared by the retrieval-baseline and MTEB tests."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]


def tiny_eval_config(tmp_path: Path, out: str, *overrides: str, n_train: int = 8) -> DictConfig:
    """The composed config with data under ``tmp_path/data`` and outputs under ``tmp_path/out``."""
    tiny_data = [
        f"data.synthetic.n_train={n_train}", "data.synthetic.n_test=12", "data.synthetic.train_groups_per_style=1",
        "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=3",
        "data.eval_datasets=[synchart,syninfo]", "model=tiny", "eval.doc_batch_size=16",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("eval", [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / out}",
                                *tiny_data, *overrides])
