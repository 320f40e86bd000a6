"""Config validation: wrong types and ranges fail up front, all at once, naming key, value and range."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from agents import GeneratorConfig
from hkrag.tasks.validation import ConfigError, Rule, validate_config

ROOT = Path(__file__).resolve().parents[1]


def config(name: str, overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("name", ["train", "eval"])
def test_shipped_configs_are_valid(name):
    validate_config(config(name))


@pytest.mark.parametrize("task", ["rag", "generation"])
@pytest.mark.parametrize("group", [f"{group}={path.stem}" for group in ("generator", "lvlm")
                                   for path in sorted((ROOT / "conf" / group).glob("*.yaml"))])
def test_shipped_rag_configs_are_valid(task, group):
    cfg = config("eval", [f"task={task}", group])
    validate_config(cfg, extra=GeneratorConfig.problems(OmegaConf.to_container(cfg.generator, resolve=True)))


def test_rag_settings_that_depend_on_each_other_are_checked_for_the_rag_tasks_only():
    problem = "rag.top_k=1 < generator.top_k=3: the generator is handed 1 page(s) but keeps up to 3"
    with pytest.raises(ConfigError, match=re.escape(problem)):
        validate_config(config("eval", ["task=rag", "rag.top_k=1"]))
    validate_config(config("eval", ["task=generation", "retrieval=none", "rag.top_k=1"]))  # no pages at all
    validate_config(config("eval", ["task=retrieval", "rag.top_k=1", "rag.pools=[nowhere]"]))  # not read


def test_generator_problems_join_the_other_groups_in_one_error():
    """The generator group is checked once, by ``GeneratorConfig``; its problems are listed with the rest."""
    cfg = config("eval", ["task=rag", "rag.concurrency=0", "generator.threshold=1.5", "generator.pruner=maybe"])
    extra = GeneratorConfig.problems(OmegaConf.to_container(cfg.generator, resolve=True))
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, extra=extra)
    for problem in ("rag.concurrency=0: expected an integer >= 1",
                    "generator.threshold=1.5: expected a number >= 0 and <= 1",
                    "generator.pruner='maybe': expected true or false"):
        assert problem in str(info.value)
    assert str(info.value).count("\n  ") == 3


@pytest.mark.parametrize("experiment", ["hkrag_retriever", "ablation_infonce", "demo", "reader_regions_tiny",
                                        "reader_regions_detected_tiny"])
def test_experiments_are_valid(experiment):
    validate_config(config("train", [f"experiment={experiment}"]))


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.global_batch_size=abc", "trainer.global_batch_size='abc': expected an integer >= 1"),
        ("trainer.global_batch_size=-8", "trainer.global_batch_size=-8: expected an integer >= 1"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size=0: expected an integer >= 1"),
        ("trainer.global_batch_size=2.5", "trainer.global_batch_size=2.5: expected an integer >= 1"),
        ("trainer.chunk_size=-4", "trainer.chunk_size=-4: expected an integer >= 1 or null"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1: expected an integer >= 1 or null"),
        ("optim.lr=abc", "optim.lr='abc': expected a number > 0"),
        ("optim.lr=nan", "optim.lr=nan: expected a number > 0"),
        ("loss.tau=0", "loss.tau=0: expected a number > 0"),
        ("optim.warmup_ratio=1.5", "optim.warmup_ratio=1.5: expected a number >= 0 and <= 1"),
        ("eval.dtype=bf16", "eval.dtype='bf16': expected one of ['float16', 'float32']"),
        ("trainer.epochs=true", "trainer.epochs=True: expected an integer >= 1"),
    ],
)
def test_bad_value_is_named_with_its_allowed_range(override, message):
    with pytest.raises(ConfigError) as info:
        validate_config(config("train", [override]))
    assert message in str(info.value)


def test_every_problem_is_reported_in_one_error():
    cfg = config("train", ["trainer.global_batch_size=abc", "optim.lr=-1", "loss.tau=0", "trainer.max_steps=0"])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert str(info.value).count("\n  ") == 4


def test_nullable_and_open_bounds():
    assert Rule(int, low=1, nullable=True).problem(None) is None
    assert Rule(int, low=1).problem(None) == "expected an integer >= 1"
    assert Rule(float, low=0, low_open=True).problem(1e-9) is None
    assert Rule(float, low=0, low_open=True).problem(0.0) == "expected a number > 0"
    assert Rule(float, low=0).problem(3) is None  # an int is a valid number


def test_training_refuses_max_steps_minus_one_before_doing_anything(tmp_path):
    from hkrag.tasks.training import run_training

    cfg = config("train", ["trainer.max_steps=-1", f"paths.data_dir={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match="trainer.max_steps=-1"):
        run_training(cfg, tmp_path / "run")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_retrieval_evaluation_validates_first(tmp_path):
    from hkrag.tasks.retrieval import run_retrieval_evaluation

    cfg = config("eval", ["eval.top_k=0", f"paths.data_dir={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match="eval.top_k=0: expected an integer >= 1"):
        run_retrieval_evaluation(cfg, tmp_path / "eval")
    assert not (tmp_path / "data").exists()
