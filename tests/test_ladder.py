"""The model-size ladder (hkrag/tasks/ladder.py): sizes the pages cannot fit refused before any training, the job
plan (each size's generator from its own reader), the report from hand-made per-query rows, and a rerun that
re-runs nothing."""

import json
from pathlib import Path

import numpy as np
import pytest

import hkrag.tasks.common as common
from hkrag.io import read_jsonl
from hkrag.rag.records import words
from hkrag.rag.step_report import auroc
from hkrag.stats import cluster_bootstrap_interval, crossed_interval
from hkrag.tasks import ladder
from hkrag.tasks.chain import ndcg_by_query
from hkrag.tasks.ladder import LADDER, LadderConfig, LadderError, Size, check_size, sizes_named, summarize

PAGE = (224, 168)
"""The built-in corpus's page (hkrag.data.synthetic.SyntheticConfig), drawn at 12 crops (conf/model/tiny.yaml)."""


def refusal(config: dict, name: str = "bad") -> str:
    with pytest.raises(LadderError) as error:
        check_size(Size(name, config), PAGE, num_crops=12, pages=3)
    return str(error.value)


@pytest.mark.parametrize(("config", "named"), [
    ({"hidden_size": 96, "num_attention_heads": 5}, "hidden_size 96 is not divisible by num_attention_heads 5"),
    ({"hidden_size": 96, "num_attention_heads": 32, "num_key_value_heads": 32}, "gives odd heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"vision_config": {"hidden_size": 48, "num_attention_heads": 5}},
     "vision_config.hidden_size 48 is not divisible by vision_config.num_attention_heads 5"),
    ({"vision_config": {"patch_size": 5}}, "patch_size 5 does not cut a 56-px crop"),
    ({"vision_config": {"patch_size": 56}}, "patch_size 56 does not cut a 56-px crop"),  # one patch: no 2x2 merge
    ({"vision_config": {"image_size": 28}}, "image_size 28: 12 crops of 28 px hold a 224x168 page only shrunk to "
                                            "112x84"),
    # 7x7 merged tokens a crop... at 2-px patches 14x14: 2,605 tokens a page, 3 pages over the 4,096 context
    ({"vision_config": {"patch_size": 2}}, "a page is 2605 image tokens, so the top 3 with 512 of text exceed "
                                           "max_position_embeddings 4096"),
    ({"hiden_size": 128}, "unknown model.config key(s) ['hiden_size']"),
    ({"vision_config": {"patch": 7}}, "unknown model.config key(s) ['vision_config.patch']"),
])
def test_a_size_the_pages_cannot_fit_is_refused_naming_the_size_and_value(config, named):
    message = refusal(config, "w96-odd")
    assert message.startswith("ladder size 'w96-odd': ") and named in message


def test_every_rung_fits_and_a_partial_vision_config_keeps_the_tiny_tower():
    tokens = {size.name: check_size(size, PAGE, 12, 3).tokens_per_crop for size in sizes_named(list(LADDER))}
    assert tokens == {"w64-l2": 4, "w64-l4": 4, "w128-l2": 4, "w64-l2-t16": 16, "w128-l2-t16": 16, "w128-l4-t16": 16,
                      "w256-l4-t16": 16}
    vision = Size("v", {"vision_config": {"patch_size": 7}}).model_config()["vision_config"]
    assert vision["image_size"] == 56 and vision["hidden_size"] == 32  # not CLIP ViT-L's 336 px / 1024
    assert Size("v", {"num_hidden_layers": 4}).overrides() == ["++model.config.num_hidden_layers=4"]
    assert "ladder size 'bad name': a size's name is letters" in refusal({}, "bad name")


def test_an_unknown_size_name_is_refused_naming_the_known_ones(tmp_path, capsys):
    with pytest.raises(LadderError, match=r"unknown ladder size\(s\) \['huge'\]: the known sizes are \['w64-l2'"):
        sizes_named(["w64-l2", "huge"])
    with pytest.raises(SystemExit):
        ladder.main(["--out", str(tmp_path), "--sizes", "huge"])
    assert "the known sizes are" in capsys.readouterr().err


def test_a_bad_size_is_refused_before_any_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(LADDER, "w96-h5", {"hidden_size": 96, "num_attention_heads": 5})
    ran = []
    monkeypatch.setattr(common, "run_job", lambda *job: ran.append(job[0]) or 0.0)
    with pytest.raises(SystemExit) as exit_:
        ladder.main(["--out", str(tmp_path / "out"), "--sizes", "w64-l2", "w96-h5"])
    assert exit_.value.code == 2 and ran == []
    assert "ladder size 'w96-h5': hidden_size 96 is not divisible by num_attention_heads 5" in capsys.readouterr().err


def test_the_plan_trains_each_sizes_generator_from_its_own_reader(tmp_path):
    config = LadderConfig(tmp_path, sizes=["w64-l2", "w128-l2-t16"], seeds=[0, 1], rerank=True,
                          overrides=["paths.data_dir=D"], eval_overrides=["rag.max_queries=3"])
    jobs = ladder.plan(config, {"reader": 30, "generator": 15})
    assert {stage: len(found) for stage, found in jobs.items()} == {"reader": 4, "stage1": 4, "generator": 4,
                                                                   "runs": 16, "rerank": 4}
    folder = config.folder
    reader = {job[0]: job[1] for job in jobs["reader"]}[folder("w128-l2-t16", "reader", 1)]
    assert reader[:2] == ["experiment=reader_tiny", "trainer.seed=1"] and "trainer.max_steps=30" in reader
    assert "++model.config.hidden_size=128" in reader and "paths.data_dir=D" in reader
    assert not any("model.config" in item for item in {j[0]: j[1] for j in jobs["reader"]}[folder("w64-l2",
                                                                                                   "reader", 0)])
    for size in ("w64-l2", "w128-l2-t16"):
        for seed in (0, 1):
            own = folder(size, "reader", seed)
            stage1 = {j[0]: j[1] for j in jobs["stage1"]}[folder(size, "stage1", seed)]
            generator = {j[0]: j[1] for j in jobs["generator"]}[folder(size, "generator", seed)]
            assert f"generator_training.init_from={own}" in stage1 and "generator_training.pages=[gold]" in stage1
            assert f"generator_training.init_from={folder(size, 'stage1', seed)}" in generator
            assert "+generator_training.optim.loss_mean=example" in generator
            for trained in (stage1, generator):
                assert f"generator_training.retriever.run_dir={own}" in trained
                assert f"generator_training.optim.seed={seed}" in trained
                assert "generator_training.optim.max_steps=15" in trained
    runs = {job[0].name: job[1] for job in jobs["runs"]}
    served = runs["w128-l2-t16-retrieved-hkrag-s1"]
    assert served[:2] == ["task=rag", common.UNGROUNDED] and "generator=hkrag" in served
    assert f"run_dir={folder('w128-l2-t16', 'reader', 1)}" in served and "rag.max_queries=3" in served
    assert f"lvlm.base={folder('w128-l2-t16', 'generator', 1) / common.BASE_DIR}" in served
    assert runs["w64-l2-gold-single_pass-s0"][:3] == ["task=generation", common.UNGROUNDED, "generator=single_pass"]
    assert all(common.UNGROUNDED in overrides for overrides in runs.values())
    rerank = jobs["rerank"][0]
    assert rerank[1][:3] == ["task=retrieval", "retriever=rerank", f"run_dir={folder('w64-l2', 'reader', 0)}"]
    assert ladder.plan(LadderConfig(tmp_path, sizes=["w64-l2"]), {"reader": 1, "generator": 1})["rerank"] == []


def test_training_runs_checkpoint_every_save_every_steps_so_an_interrupted_one_continues(tmp_path):
    """Every training job saves a checkpoint every ``save_every`` steps (what run_job continues from), none with
    0; a negative interval is refused naming it."""
    def trained(config: LadderConfig) -> list[list[str]]:
        jobs = ladder.plan(config, {"reader": 30, "generator": 15})
        return [job[1] for stage in ("reader", "stage1", "generator") for job in jobs[stage]]

    reader, stage1, generator = trained(LadderConfig(tmp_path, sizes=["w64-l2"], save_every=7))
    assert "trainer.save_every=7" in reader
    assert all("generator_training.optim.save_every=7" in job for job in (stage1, generator))
    assert not any("save_every" in item for job in trained(LadderConfig(tmp_path, sizes=["w64-l2"], save_every=0))
                   for item in job)
    with pytest.raises(ValueError, match="save_every=-1"):
        LadderConfig(tmp_path, sizes=["w64-l2"], save_every=-1)


def test_steps_are_the_recipes_scaled_unless_given():
    assert ladder.training_steps(LadderConfig("o", steps_scale=0.01)) == {"reader": 30, "generator": 15}
    assert ladder.training_steps(LadderConfig("o", steps_scale=0.01, generator_steps=2)) == {"reader": 30,
                                                                                             "generator": 2}
    with pytest.raises(ValueError, match="steps_scale=0"):
        LadderConfig("o", steps_scale=0)


def rows_of(size: str, run: str, seed: int, scores: dict[tuple[str, str], float], seconds: float = 1.0) -> list[dict]:
    pages, generator = run.split("-", 1)
    return [{"size": size, "pages": pages, "generator": generator, "seed": seed, "dataset": "synchart",
             "pool": pool, "query_id": query, "score": score, "seconds": seconds}
            for (pool, query), score in scores.items()]


GOLD = {("gold", "q1"): 1.0, ("gold", "q2"): 1.0, ("gold", "q3"): 0.0, ("gold", "q4"): 0.0}


def hand_rows() -> list[dict]:
    """Two sizes. ``small`` (one seed): on the top 3 (q1..q3 in pools single and all) single pass 4/6 right, agents
    3/6, a loss of 1/6; ``large`` (two seeds): agents 5/6 and 4/6 against single pass 3/6 and 3/6."""
    rows = []
    top = ["q1", "q2", "q3"]

    def top3(*right: tuple[str, str]) -> dict:
        return {(pool, q): float((pool, q) in right) for pool in ("single", "all") for q in top}

    rows += rows_of("small", "gold-single_pass", 0, GOLD) + rows_of("small", "gold-hkrag", 0, GOLD)
    rows += rows_of("small", "retrieved-single_pass", 0, top3(("single", "q1"), ("all", "q1"), ("single", "q2"),
                                                             ("all", "q2")), seconds=0.5)
    rows += rows_of("small", "retrieved-hkrag", 0, top3(("single", "q1"), ("all", "q1"), ("single", "q2")),
                    seconds=2.5)
    for seed, agents in ((0, [("single", "q1"), ("all", "q1"), ("single", "q2"), ("all", "q2"), ("single", "q3")]),
                         (1, [("single", "q1"), ("all", "q1"), ("single", "q2"), ("all", "q3")])):
        rows += rows_of("large", "gold-single_pass", seed, GOLD) + rows_of("large", "gold-hkrag", seed, GOLD)
        rows += rows_of("large", "retrieved-single_pass", seed, top3(("single", "q1"), ("all", "q1"),
                                                                     ("single", "q2")))
        rows += rows_of("large", "retrieved-hkrag", seed, top3(*agents))
    return rows


EXTRAS = {"small": {"training_minutes": 20.0,
                    "steps": {"pruner_auroc_all_pool": {"auroc": 0.65, "low": 0.5, "high": 0.8, "n": 10,
                                                        "positives": 4},
                              "notes_code": {"hits": 1, "n": 10, "rate": 0.1},
                              "gold_steps": {"answer": 0.25, "verify": 0.5, "integrate": None}}},
          "large": {"training_minutes": 120.0,
                    "steps": {"pruner_auroc": {"auroc": 0.95, "low": 0.9, "high": 0.99, "n": 10, "positives": 4},
                              "notes_code": {"hits": 9, "n": 10, "rate": 0.9},
                              "gold_steps": {"answer": 0.5, "verify": 0.75, "integrate": 0.5}}}}


def test_the_report_is_a_function_of_the_per_query_rows():
    report = summarize(hand_rows(), ["small", "large"], EXTRAS)
    small, large = report["sizes"]["small"], report["sizes"]["large"]
    assert small["accuracy"]["gold-single_pass"]["mean"] == 0.5
    assert small["accuracy"]["retrieved-single_pass"]["mean"] == pytest.approx(4 / 6)
    assert small["accuracy"]["retrieved-hkrag"]["mean"] == pytest.approx(3 / 6)
    assert small["agents_minus_single_pass"]["diff"] == pytest.approx(-1 / 6)
    # one seed: the percentile bootstrap over questions, a question's two pools one cluster
    keys = sorted((pool, q) for pool in ("single", "all") for q in ("q1", "q2", "q3"))
    diffs = [-1.0 if key == ("all", "q2") else 0.0 for key in keys]
    expected = cluster_bootstrap_interval(diffs, [q for _, q in keys])
    assert (small["agents_minus_single_pass"]["low"], small["agents_minus_single_pass"]["high"]) == expected
    assert small["seconds_per_query"]["retrieved-hkrag"] == 2.5
    assert large["accuracy"]["retrieved-hkrag"]["mean"] == pytest.approx(9 / 12)
    assert large["agents_minus_single_pass"]["diff"] == pytest.approx(9 / 12 - 6 / 12)
    # two seeds: the crossed interval of the (seeds, questions) matrix, each question's pools averaged
    agents = np.array([[1.0, 1.0, 0.5], [1.0, 0.5, 0.5]])  # q1, q2, q3 per seed
    found = crossed_interval(agents, bounds=(0.0, 1.0))
    assert (large["accuracy"]["retrieved-hkrag"]["low"], large["accuracy"]["retrieved-hkrag"]["high"]) == \
        pytest.approx((found["low"], found["high"]))
    assert report["smallest_paying_size"] == "large" and report["trains_within_default_budget"] is False
    assert report["enough_seeds_for_default"] is False  # two seeds, below DEFAULT_SEEDS
    assert small["failing_steps"] == ["Pruner: AUROC 0.650 < 0.90 on the top 3 (all pool)",
                                      "Decoupler: notes name the code 10.0 % < 80 %",
                                      "answer: 25.0 % < single pass 50.0 % on gold pages"]
    assert large["failing_steps"] == []
    text = ladder.markdown({"settings": {"command": "", "training_steps": {"reader": 1, "generator": 1},
                                         "reader": "r", "generator": "g", "seeds": [0, 1]}, **report})
    assert "**The smallest size at which the agents reach the single pass on the top 3: `large`** (trains in more " \
           "than 90 min; fewer than 3 seeds: exploratory, the shipped default changes only on a figure over 3 or " \
           "more)" in text
    assert "| small |  | 1 | 50.0 [" in text and "- `large`: none" in text


def test_training_minutes_are_each_seeds_reader_and_stages_and_missing_time_is_none(tmp_path):
    config = LadderConfig(tmp_path, sizes=["w64-l2"], seeds=[0, 1])
    timings = {f"w64-l2-{job}-s{seed}": seconds * (seed + 1)
               for seed in (0, 1) for job, seconds in (("reader", 600.0), ("stage1", 60.0), ("generator", 540.0))}
    timings["w64-l2-gold-hkrag-s0"] = 9000.0  # an answer run is not training
    assert ladder.training_minutes(timings, config, "w64-l2", [0, 1]) == [20.0, 40.0]
    del timings["w64-l2-stage1-s1"]
    assert ladder.training_minutes(timings, config, "w64-l2", [0, 1]) is None
    rows = hand_rows()
    report = summarize(rows, ["large"], {"large": {**EXTRAS["large"], "training_minutes": 30.0,
                                                   "training_minutes_by_seed": [20.0, 40.0]}})
    text = ladder.markdown({"settings": {"command": "", "training_steps": {"reader": 1, "generator": 1},
                                         "reader": "r", "generator": "g", "seeds": [0, 1]}, **report})
    assert "| 30.0 (20.0 / 40.0) |" in text


def test_a_rung_reaching_on_three_seeds_is_enough_for_the_default():
    rows = hand_rows()
    rows += [{**row, "seed": 2} for row in rows if row["size"] == "large" and row["seed"] == 1]
    report = summarize(rows, ["small", "large"], EXTRAS)
    assert report["smallest_paying_size"] == "large" and report["enough_seeds_for_default"] is True
    text = ladder.markdown({"settings": {"command": "", "training_steps": {"reader": 1, "generator": 1},
                                         "reader": "r", "generator": "g", "seeds": [0]}, **report})
    assert "`large`** (trains in more than 90 min).\n" in text and "exploratory" not in text


def test_a_size_whose_single_pass_reads_nothing_does_not_reach_it():
    rows = [{**row, "score": 0.0} for row in hand_rows() if row["size"] == "large"]
    report = summarize(rows, ["large"], {})
    assert report["sizes"]["large"]["agents_minus_single_pass"]["diff"] == 0
    assert report["smallest_paying_size"] is None and report["trains_within_default_budget"] is None
    assert report["sizes"]["large"]["failing_steps"][0] == ladder.NOTHING_TO_REACH


def test_a_missing_seed_row_is_refused():
    rows = [row for row in hand_rows() if not (row["size"] == "large" and row["seed"] == 1 and row["query_id"] == "q3"
                                               and row["generator"] == "hkrag" and row["pages"] == "retrieved")]
    with pytest.raises(ValueError, match="the seeds answered different queries"):
        summarize(rows, ["large"], {})


def test_a_second_invocation_re_runs_nothing(tmp_path, monkeypatch):
    """Every job of the plan runs once: a rerun finds each done file and runs none (the report is stubbed)."""
    ran = []

    def fake(folder, overrides, config="train", done=common.REPORT_FILE):
        ran.append(folder.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / done).write_text("{}")
        return 1.0

    def report(config, models, steps, timings):
        (config.out / "ladder.md").write_text("")
        return dict(timings)

    monkeypatch.setattr(common, "run_job", fake)
    monkeypatch.setattr(ladder, "write_report", report)
    argv = ["--out", str(tmp_path), "--sizes", "w64-l2", "w128-l2-t16", "--seeds", "0", "1", "--steps-scale", "0.001"]
    first = ladder.main(argv)
    assert len(ran) == 2 * 2 * 7 and len(first) == len(ran)
    ran.clear()
    assert ladder.main(argv) == first and ran == []
    assert json.loads((tmp_path / common.TIMINGS_FILE).read_text()) == first


DATA = ["data.synthetic.n_train=16", "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
        "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart]"]


def test_a_tiny_rung_end_to_end_and_again(tmp_path, monkeypatch):
    """12–16 s on the shared 2 cores (load 5–6): a 2-step reader, two 2-step generator stages, four runs of 3
    questions."""
    data = f"paths.data_dir={tmp_path / 'data'}"
    argv = ["--out", str(tmp_path / "out"), "--sizes", "w64-l2", "--reader-steps", "2", "--generator-steps", "2",
            *(f"--eval={o}" for o in (data, *DATA, "rag.max_queries=3")), data, *DATA, "eval_before_after=false",
            "trainer.global_batch_size=4"]
    first = ladder.main(argv)
    row = first["sizes"]["w64-l2"]
    assert row["accuracy"]["retrieved-hkrag"]["rows"] == 6 and row["accuracy"]["gold-hkrag"]["rows"] == 3
    assert row["training_minutes"] > 0 and set(row["steps"]) >= {"pruner_auroc", "notes_code", "gold_steps"}
    lines = (tmp_path / "out" / ladder.PER_QUERY).read_text().splitlines()
    assert len(lines) == 2 * 3 + 2 * 6  # gold runs 3 rows each, top-3 runs 3 questions x 2 pools
    assert (tmp_path / "out" / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    ran = []
    monkeypatch.setattr(common, "run_job", lambda *job: ran.append(job[0]) or 0.0)
    assert ladder.main(argv) == first and ran == []


def test_the_reranker_figures_are_means_over_seeds_of_the_per_query_ndcg(tmp_path):
    config = LadderConfig(tmp_path, sizes=["w64-l2"], seeds=[0, 1], rerank=True)
    for seed, (fine, chart) in enumerate(((0.5, 1.0), (0.3, 0.0))):
        scores = {"synfine": {"all": {"a": {"ndcg@5": fine}, "b": {"ndcg@5": fine}}},
                  "synchart": {"all": {"c": {"ndcg@5": chart}}, "single": {"c": {"ndcg@5": 1.0}}}}
        (config.folder("w64-l2", "rerank", seed)).mkdir(parents=True)
        (config.folder("w64-l2", "rerank", seed) / "per_query.json").write_text(json.dumps(scores))
    found = ladder.rerank_figures(config, "w64-l2", [0, 1])
    assert found["reranked"] == {"synfine_all": pytest.approx(0.4), "all_pool": pytest.approx((0.75 + 0.15) / 2)}
    assert found["reader"] is None  # the reader made no evaluation after training (eval_before_after=false)
    assert ladder.rerank_figures(LadderConfig(tmp_path, sizes=["w64-l2"]), "w64-l2", [0, 1]) is None


def test_a_size_reports_every_seed_finished_in_the_folder(tmp_path):
    """A rung run earlier with seeds 0-2 keeps them when the ladder is re-run with seed 0; a seed missing one answer
    run (or, with rerank, its reranked retrieval) is left out; ``w64-l2-t16``'s folders are not ``w64-l2``'s."""
    config = LadderConfig(tmp_path, sizes=["w64-l2", "w64-l2-t16"], seeds=[0], rerank=True)

    def finish(size: str, seed: int, jobs) -> None:
        for job in jobs:
            folder = config.folder(size, job, seed)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ("retrieval.json" if job == "rerank" else "rag.json")).write_text("{}")

    for seed in (0, 1, 2, 11):
        finish("w64-l2", seed, [*ladder.RUNS, "rerank"])
    finish("w64-l2", 3, ladder.RUNS)  # no reranked retrieval
    finish("w64-l2", 4, [*ladder.RUNS[:-1], "rerank"])  # an answer run unfinished
    finish("w64-l2-t16", 5, [*ladder.RUNS, "rerank"])
    assert ladder.finished_seeds(config, "w64-l2") == [0, 1, 2, 11]
    assert ladder.finished_seeds(config, "w64-l2-t16") == [5]
    assert ladder.finished_seeds(LadderConfig(tmp_path, sizes=["w64-l2"]), "w64-l2") == [0, 1, 2, 3, 11]


COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "ladder"


@pytest.mark.parametrize("folder, reader_steps", [(COMMITTED, 3000), (COMMITTED / "r6000", 6000),
                                                  (COMMITTED / "t16", 6000), (COMMITTED / "l4t16", 6000)],
                         ids=["ladder", "r6000", "t16", "l4t16"])
def test_the_committed_ladder_re_derives_from_its_per_query_data(folder, reader_steps):
    """docs/ladder/ladder.json (the w128-l2 rung on a 6,000-step reader, docs/ladder/r6000, the w128-l2-t16 rung,
    docs/ladder/t16, and the w128-l4-t16 one, docs/ladder/l4t16): the accuracies, paired differences and nDCG@5
    figures follow from the committed per-query rows and per-query nDCG (a report edited by hand, or built from
    other runs, fails)."""
    report = json.loads((folder / "ladder.json").read_text())
    rows = [json.loads(line) for line in (folder / ladder.PER_QUERY).read_text().splitlines()]
    assert {row["size"] for row in rows} == set(report["sizes"])
    assert report["settings"]["training_steps"] == {"reader": reader_steps, "generator": 1500}
    for size, row in report["sizes"].items():
        found = ladder.size_row(rows, size)
        assert sorted({r["seed"] for r in rows if r["size"] == size}) == row["seeds"]
        for run in ladder.RUNS:
            for key in ("mean", "low", "high", "rows", "seeds"):
                assert found["accuracy"][run][key] == pytest.approx(row["accuracy"][run][key]), (size, run, key)
        for key in ("diff", "low", "high"):
            assert found["agents_minus_single_pass"][key] == pytest.approx(row["agents_minus_single_pass"][key])
        for name, prefix in (("reranked", "rerank"), ("reader", "reader")):
            scores = [ndcg_by_query(json.loads((folder / f"{prefix}_{size}_s{seed}_per_query.json").read_text()))
                      for seed in row["seeds"]]
            assert ladder.ndcg_means(scores) == pytest.approx(row["rerank"][name]), (size, name)


def test_the_reader_step_budget_check_re_derives_from_its_per_query_data():
    """docs/ladder/budget: the w128-l2 reader at 3,000 and 6,000 steps and the w64-l2 one on the validation corpora
    (docs/training.md, "What a larger rung needs first"): each figure is the mean of its committed per-query nDCG@5,
    and twice the steps lift the width-128 reader on every corpus."""
    report = json.loads((COMMITTED / "budget" / "budget.json").read_text())["readers"]
    for name, figures in report.items():
        for d, (all_pool, synfine) in enumerate(zip(figures["all_pool"], figures["synfine_all"]), start=1):
            scores = ndcg_by_query(json.loads((COMMITTED / "budget" / f"{name}_d{d}_per_query.json").read_text()))
            assert all_pool == pytest.approx(np.mean([v for ds in scores.values() for v in ds["all"].values()]))
            assert synfine == pytest.approx(np.mean(list(scores["synfine"]["all"].values())))
    assert all(a > b for a, b in zip(report["w128-l2_6000"]["all_pool"], report["w128-l2_3000"]["all_pool"]))


@pytest.mark.parametrize("budget", ["g1500", "g3000"])
def test_the_generator_step_budget_check_re_derives_from_its_traces(budget):
    """docs/ladder/budget/generator: the width-128 generator's stage 2 at 1,500 (shipped) and 3,000 steps on the
    validation questions (docs/training.md): each final-answer rate is the mean of its committed trace's relaxed
    accuracy, and the agents' Pruner AUROC follows from the committed calls."""
    folder = COMMITTED / "budget" / "generator" / budget
    reports = json.loads((folder / "steps.json").read_text())["reports"]
    for name in ("agents-gold", "agents-retrieved", "single_pass-gold", "single_pass-retrieved"):
        scores = [row["metrics"]["relaxed_accuracy"] for row in read_jsonl(folder / f"{name}.jsonl.gz")]
        assert len(scores) == 108 and reports[name]["answers"]["final"]["hits"] == sum(scores), name
    calls = read_jsonl(folder / "agents-retrieved-pruner_calls.jsonl.gz")
    found = reports["agents-retrieved"]["pruner"]["p_yes"]["auroc"]
    assert auroc([c["p_yes"] for c in calls], [c["label"] for c in calls]) == pytest.approx(found["auroc"])


@pytest.mark.parametrize("split, questions", [("validation", 108), ("test", 124)])
def test_the_notes_stage_code_rate_re_derives_from_its_traces(split, questions, builtin_data):
    """docs/ladder/notes_stage: the forced fine-print notes on gold pages (each question's first iteration) name the
    page's drawn code (as a whole word) in as many questions as the committed report says (docs/training.md, "A
    dedicated notes stage")."""
    folder = COMMITTED / "notes_stage"
    codes = {row["doc_id"]: row["code"] for row in read_jsonl(builtin_data / "pages.jsonl")}
    rows = read_jsonl(folder / f"{split}_forced_gold_trace.jsonl.gz")
    notes = [(call["output"], codes[row["retrieved"][0]]) for row in rows for call in row["calls"]
             if call["step"] == "fine_print" and call["iteration"] == 1]
    reported = json.loads((folder / f"{split}_forced_steps.json").read_text())["reports"]["forced-gold"]["notes"]
    assert len(rows) == len(notes) == questions == reported["fine_print code"]["n"]
    assert sum(code in words(output) for output, code in notes) == reported["fine_print code"]["hits"]


@pytest.mark.parametrize("h", ["0.25", "0.38", "0.50", "0.60"])
def test_the_notes_stage_threshold_sweep_re_derives_from_its_traces(h):
    """docs/ladder/notes_stage/h_sweep: the agents' final answers on the validation questions at each Judger threshold
    h are the committed traces' relaxed accuracy, and every query above h took the notes route (HQP)."""
    folder = COMMITTED / "notes_stage" / "h_sweep" / f"h{h}"
    report = json.loads((folder / "steps.json").read_text())
    assert report["generator_overrides"] == [f"threshold={h}"]
    for name in ("agents-gold", "agents-retrieved"):
        rows = read_jsonl(folder / f"{name}.jsonl.gz")
        final = report["reports"][name]["answers"]["final"]
        assert len(rows) == final["n"] == 108 and sum(r["metrics"]["relaxed_accuracy"] for r in rows) == final["hits"]
        assert all((r["route"] == "HQP") == (r["uncertainty"] >= float(h)) for r in rows)
