"""Shared fixtures: a tiny random Phi3V (same code path as the 4.2B model) and a few pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

REFERENCE_PHI3V = Path(__file__).resolve().parents[2] / "shared" / "reference" / "phi3v"


@pytest.fixture(scope="session")
def reference_phi3v() -> Path:
    """The public Phi-3-vision config/tokenizer files (no weights); tests skip when absent."""
    if not (REFERENCE_PHI3V / "config.json").exists():
        pytest.skip(f"reference Phi-3-vision files not found at {REFERENCE_PHI3V}")
    return REFERENCE_PHI3V


@pytest.fixture(scope="session")
def builtin_data(tmp_path_factory) -> Path:
    """The built-in synthetic corpus as ``train.py`` generates it (conf/data/synthetic.yaml), in a folder of this
    session: what the committed runs read from ``data/synthetic``, which a fresh checkout does not hold."""
    from hydra import compose, initialize_config_dir

    from hkrag.tasks.common import CONF_DIR, prepare_data

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.data_dir={tmp_path_factory.mktemp('data')}"])
    prepare_data(cfg.data)
    return Path(cfg.data.root)


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """``HKRAG_CACHE`` for every test and the commands it starts: a folder of this session, never the user's
    ``~/.cache/hkrag``; a page one test grounded is not OCRed again by the next (hkrag.data.ocr.WordBoxCache)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HKRAG_CACHE", str(tmp_path_factory.mktemp("hkrag-cache")))
        yield


@pytest.fixture
def tiny():
    """A fresh tiny causal Phi3V and its offline processor."""
    from hkrag.models.phi3v import tiny_phi3v

    model, processor = tiny_phi3v(num_crops=4, seed=0)
    return model.eval(), processor


@pytest.fixture
def pages() -> list[Image.Image]:
    """Pages of different sizes and orientations, with content so embeddings differ."""
    out = []
    for i, (w, h) in enumerate([(100, 80), (300, 120), (40, 200), (56, 56)]):
        image = Image.new("RGB", (w, h), (255, 255, 255))
        image.paste((40 * i, 200 - 30 * i, 90), (w // 4, h // 4, w // 2, h // 2))
        out.append(image)
    return out


@pytest.fixture
def scripted_rag_backend(monkeypatch):
    """``task=rag``'s backend replaced by a scripted one that answers the Pruner "yes" and everything else "unknown"
    (Phi-3's vocabulary size); its ``requests`` are what the generator sent."""
    from hkrag.lvlm.scripted import ScriptedBackend
    from hkrag.tasks import rag as rag_task

    scripted = ScriptedBackend([("Reply with yes or no only.", "yes")], default="unknown", vocab_size=32064)
    monkeypatch.setattr(rag_task, "build_backend", lambda _config: scripted)
    return scripted


@pytest.fixture(scope="session")
def multivector_pool():
    """1,500 synthetic multi-vector pages (16 vectors each), 60 queries, their relevant pages and exact top-5 by
    MaxSim: (vectors, offsets, ids, queries, query_offsets, relevant, exact)."""
    from hkrag.index.multivector import exact_search
    from hkrag.index.synthetic_embeddings import QUERY_STREAM, MultiVectorPages

    data = MultiVectorPages(tokens=16, topics=50, words=512)
    vectors, offsets, topics = data.corpus(1500, chunk=500)
    queries, query_offsets, relevant = data.queries(vectors, offsets, topics, 60, QUERY_STREAM)
    _, exact = exact_search(queries, query_offsets, vectors, offsets, 5)
    return vectors, offsets, [f"p{i}" for i in range(len(offsets) - 1)], queries, query_offsets, relevant, exact


def tiny_training_overrides(data_dir: Path, run: Path) -> list[str]:
    """``train.py`` overrides for a two-step run on a 16-question corpus that saves a checkpoint every step."""
    return [f"paths.data_dir={data_dir}", f"paths.output_dir={run}", "data.synthetic.n_train=16",
            "data.synthetic.n_test=4", "data.synthetic.train_groups_per_style=1",
            "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
            "trainer.global_batch_size=4", "trainer.max_steps=2", "trainer.save_every=1", "eval_before_after=false"]
