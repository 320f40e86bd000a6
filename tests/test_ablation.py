"""hkrag.retrieval.ablation on a hand-built multirun folder: means, stds, paired intervals and mask shares by hand."""

import json
import math

import pytest
import yaml
from scipy import stats as scipy_stats

from hkrag.retrieval.ablation import PER_QUERY_LINES, AblationError, aggregate, load_per_query, main, summarize
from hkrag.retrieval.evaluation import PER_QUERY_FILE
from hkrag.stats import P_FLOOR, mean_and_std

QUERIES = [("synchart", "q1", "salient"), ("synchart", "q2", "fine_print"), ("synfine", "q3", "fine_print")]
SCORES = {  # (loss, seed) -> nDCG@5 of q1, q2, q3 in the single pool; the all pool scores half of it
    ("infonce", 0): (1.0, 0.0, 0.5),
    ("infonce", 1): (0.5, 0.5, 0.0),
    ("hkrag", 0): (1.0, 0.25, 0.75),
    ("hkrag", 1): (0.75, 0.75, 0.25),
    ("no_sin", 0): (1.0, 0.0, 0.5),
    ("no_sin", 1): (0.5, 0.5, 0.0),
}
MASKS = {"infonce": (0.2, 0.3, 0.5), "hkrag": (0.4, 0.4, 0.2), "no_sin": (0.25, 0.25, 0.5)}
"""(mask/one, mask/half, mask/zero) at step 1; step 2 logs 0.1 more ones and 0.1 fewer zeros."""


def write_scores(folder, values):
    per_query = {}
    for (dataset, query_id, evidence), value in zip(QUERIES, values):
        for pool, scale in (("single", 1.0), ("all", 0.5)):
            per_query.setdefault(dataset, {}).setdefault(pool, {})[query_id] = {"evidence": evidence,
                                                                                 "ndcg@5": value * scale}
    folder.mkdir()
    (folder / PER_QUERY_FILE).write_text(json.dumps(per_query))


def write_job(folder, number, loss, seed, extra=()):
    job = folder / str(number)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["experiment=demo", f"loss={loss}",
                                                                   f"trainer.seed={seed}", *extra]))
    write_scores(job / "eval-after", SCORES[loss, seed])
    one, half, zero = MASKS[loss]
    rows = [{"step": 1, "loss": 1.0, "mask/one": one, "mask/half": half, "mask/zero": zero},
            {"step": 2, "loss": 0.9, "mask/one": one + 0.1, "mask/half": half, "mask/zero": zero - 0.1}]
    (job / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def multirun(tmp_path):
    folder = tmp_path / "multirun" / "train" / "stamp"
    for number, (loss, seed) in enumerate(SCORES):
        write_job(folder, number, loss, seed)
    (folder / "multirun.yaml").write_text("hydra: {}\n")  # Hydra's own file beside the jobs is ignored
    return folder


def test_a_data_set_column_holds_its_queries_alone(multirun, tmp_path):
    summary = aggregate(multirun, tmp_path / "out", datasets=["synfine", "absent"])
    assert summary["evidence"] == ["all", "fine_print", "salient", "synfine"]  # a data set nobody scored is left out
    synfine = summary["ndcg@5"]["single"]["synfine"]
    assert synfine["hkrag"]["per_seed"] == pytest.approx([0.75, 0.25]) and synfine["hkrag"]["num_queries"] == 1
    assert summary["vs_baseline"]["all"]["synfine"]["hkrag"]["diff"] == pytest.approx(0.5 * (0.5 - 0.25))
    assert "| loss | all | fine_print | salient | synfine |" in (tmp_path / "out" / "ablation.md").read_text()


def test_means_stds_and_paired_intervals_equal_hand_computed_values(multirun):
    summary = aggregate(multirun)
    assert summary["conditions"] == ["infonce", "hkrag", "no_sin"]  # baseline first, then in job order
    assert summary["evidence"] == ["all", "fine_print", "salient"]
    single = summary["ndcg@5"]["single"]
    # hkrag, all queries: seed 0 (1 + 0.25 + 0.75)/3 = 2/3, seed 1 (0.75 + 0.75 + 0.25)/3 = 7/12
    assert single["all"]["hkrag"]["per_seed"] == pytest.approx([2 / 3, 7 / 12])
    assert single["all"]["hkrag"]["mean"] == pytest.approx(0.625)
    assert single["all"]["hkrag"]["std"] == pytest.approx(math.sqrt(2) * (2 / 3 - 0.625))
    # fine print of infonce: seed 0 (0 + 0.5)/2, seed 1 (0.5 + 0)/2: no spread over seeds
    assert {k: v for k, v in single["fine_print"]["infonce"].items() if k not in ("low", "high")} == {
        "mean": pytest.approx(0.25), "std": pytest.approx(0.0), "per_seed": pytest.approx([0.25, 0.25]),
        "num_queries": 2}
    assert single["salient"]["no_sin"]["mean"] == pytest.approx(0.75)
    assert summary["ndcg@5"]["all"]["salient"]["no_sin"]["mean"] == pytest.approx(0.375)
    # no_sin scores every query as infonce does: difference 0, interval [0, 0], p = 1
    same = summary["vs_baseline"]["single"]["all"]["no_sin"]
    assert (same["diff"], same["low"], same["high"], same["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    # hkrag - infonce per query, averaged over seeds 0 and 1: q1 (0 + 0.25)/2, q2 (0.25 + 0.25)/2, q3 (0.25 + 0.25)/2
    versus = summary["vs_baseline"]["single"]["fine_print"]["hkrag"]
    assert versus["diff"] == pytest.approx(0.25) and versus["low"] == versus["high"] == pytest.approx(0.25)
    assert versus["p_value"] == P_FLOOR and versus["seeds"] == [0, 1] and versus["num_queries"] == 2  # never 0
    # crossed seeds x queries: hkrag - infonce is (0, .25, .25) for seed 0 and (.25, .25, .25) for seed 1, mean 5/24.
    # Seed means 1/6, 1/4: MS_seed = 3 * 2 * (1/24)^2 = 1/96; query means 1/8, 1/4, 1/4: MS_query = 2 * 6/576 / 2
    # = 1/96; SS_total = 5/16 - 6 * (5/24)^2 = 5/96, SS_residual = 5/96 - 1/96 - 2/96 = 1/48 on 2 df: MS 1/96.
    # Both components are 0: Var(mean) = MS_residual / (S Q) = 1/576, se 1/24, on the residual's 2 df.
    everything = summary["vs_baseline"]["single"]["all"]["hkrag"]
    half = scipy_stats.t.ppf(0.975, 2) / 24
    assert (everything["diff"], everything["se"], everything["df"]) == pytest.approx((5 / 24, 1 / 24, 2))
    assert (everything["low"], everything["high"]) == pytest.approx((5 / 24 - half, 5 / 24 + half))  # [2.9, 38.8]
    # each condition's mean carries its own crossed interval
    assert single["all"]["hkrag"]["low"] < 0.625 < single["all"]["hkrag"]["high"]
    assert single["fine_print"]["infonce"]["low"] <= 0.25 <= single["fine_print"]["infonce"]["high"]


def test_mask_shares_and_written_files(multirun):
    summary = aggregate(multirun)
    masks = summary["masks"]["hkrag"]
    assert masks["mean"] == pytest.approx({"mask/one": 0.45, "mask/half": 0.4, "mask/zero": 0.15})
    assert masks["steps"] == [1, 2] and masks["curve"]["mask/zero"] == pytest.approx([0.2, 0.1])
    assert json.loads((multirun / "ablation.json").read_text())["conditions"] == ["infonce", "hkrag", "no_sin"]
    text = (multirun / "ablation.md").read_text()
    assert "| hkrag | 62.5 ± 5.9 |" in text and "| hkrag | +20.8 [" in text
    assert "| hkrag | 0.450 | 0.400 | 0.150 |" in text
    assert (multirun / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seeds_are_matched_and_bad_folders_are_named(multirun, tmp_path):
    (multirun / "2" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["loss=hkrag", "trainer.seed=7"]))
    summary = aggregate(multirun, tmp_path / "out")
    assert summary["seeds"]["hkrag"] == [1, 7] and summary["vs_baseline"]["single"]["all"]["hkrag"]["seeds"] == [1]
    with pytest.raises(AblationError, match="baseline 'bogus' is not among the conditions"):
        aggregate(multirun, baseline="bogus")
    (multirun / "5" / "eval-after" / PER_QUERY_FILE).unlink()
    with pytest.raises(AblationError, match=r"5: eval-after/per_query.json is missing"):
        aggregate(multirun)
    partial = aggregate(multirun, tmp_path / "partial", finished_only=True)
    assert partial["seeds"] == {"infonce": [0, 1], "hkrag": [1, 7], "no_sin": [0]}


def test_cli_errors_name_the_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2 and "nowhere holds no job folders" in capsys.readouterr().err


def test_verdicts_on_the_table_5_claims_that_ran(multirun):
    summary = aggregate(multirun)
    verdicts = {(v["better"], v["worse"], v["evidence"], v["pool"]): v for v in summary["verdicts"]}
    # no_din did not run: its claims are left out; every other claim is judged in both pools
    assert {key[:3] for key in verdicts} == {("hkrag", "infonce", "all"), ("hkrag", "no_sin", "all"),
                                             ("no_sin", "infonce", "all"), ("hkrag", "no_sin", "fine_print")}
    # a zero-width interval is inconclusive, never (not) reproduced: identical runs give [0, 0] ...
    assert verdicts["no_sin", "infonce", "all", "single"]["verdict"] == "inconclusive"
    fine = verdicts["hkrag", "no_sin", "fine_print", "single"]  # ... and +0.25 on every seed and query [0.25, 0.25]
    assert (fine["low"], fine["high"], fine["verdict"]) == (pytest.approx(0.25), pytest.approx(0.25), "inconclusive")
    text = (multirun / "ablation.md").read_text()
    assert "## Verdicts on the paper's claims" in text and "| fine_print | single | +25.0 [+25.0, +25.0] | < 1e-4 | " \
        "inconclusive | < 1e-4 | [+25.0, +25.0] | **inconclusive** |" in text
    assert "margin (smallest effect of interest) 1 nDCG@5 points" in text and "m = 8 verdicts" in text
    # Holm over the 8 verdicts: the smallest p is multiplied by 8; intervals at 1 - 0.05/8 = 99.375 %
    everything = verdicts["hkrag", "infonce", "all", "single"]
    assert everything["p_holm"] >= everything["p_value"] and everything["corrected_confidence"] == 1 - 0.05 / 8
    assert everything["corrected_low"] < everything["low"] < everything["high"] < everything["corrected_high"]
    assert everything["verdict"] == "reproduced"  # [+2.9, +38.8] at 95 %, p = 0.038
    assert everything["corrected_verdict"] == "inconclusive"  # reaches below 0 at 99.375 %; Holm p above 0.05
    assert everything["p_holm"] > 0.05


def test_learning_curves_average_seeds_per_step(tmp_path):
    folder = tmp_path / "sweep"
    for number, (loss, seed) in enumerate([("infonce", 0), ("infonce", 1), ("hkrag", 0), ("hkrag", 1)]):
        write_job(folder, number, loss, seed)
        job = folder / str(number)
        write_scores(job / "eval-before", (0.0, 0.0, 0.0))
        write_scores(job / "eval-step-2", [v / 2 for v in SCORES[loss, seed]])
        write_scores(job / "eval-step-4", SCORES[loss, seed])
    summary = aggregate(folder)
    curve = summary["curves"]["single"]["all"]["hkrag"]
    assert curve["steps"] == [0, 2, 4]  # eval-before is step 0
    assert curve["mean"] == pytest.approx([0.0, 0.3125, 0.625])
    assert curve["std"][2] == pytest.approx(math.sqrt(2) * (2 / 3 - 0.625))
    assert curve["last_change"] == pytest.approx(0.3125)
    assert "| hkrag | 0–4 (3 points) | 0.0 ± 0.0 | 62.5 ± 5.9 | +31.2 |" in (folder / "ablation.md").read_text()


def test_conditions_from_several_keys_or_every_varying_override(tmp_path):
    folder = tmp_path / "grid"
    jobs = [("infonce", 0, ()), ("hkrag", 0, ("loss.alpha=2",)), ("hkrag", 0, ("loss.alpha=0.5",)),
            ("infonce", 1, ()), ("hkrag", 1, ("loss.alpha=2",)), ("hkrag", 1, ("loss.alpha=0.5",))]
    for number, (loss, seed, extra) in enumerate(jobs):
        write_job(folder, number, loss, seed, extra)
    labels = ["loss=infonce", "loss=hkrag,loss.alpha=2", "loss=hkrag,loss.alpha=0.5"]
    keyed = aggregate(folder, by=["loss", "loss.alpha"], baseline="loss=infonce")
    assert keyed["conditions"] == labels and keyed["seeds"]["loss=hkrag,loss.alpha=2"] == [0, 1]
    assert aggregate(folder, by="auto", baseline="loss=infonce")["conditions"] == labels
    with pytest.raises(AblationError, match="repeats loss=hkrag trainer.seed=0"):
        aggregate(folder)  # by loss alone, the two alphas collide


def test_mean_and_std():
    assert mean_and_std([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2
                                                                                + (4 - 7 / 3) ** 2) / 2)))
    assert mean_and_std([0.5]) == (0.5, 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        mean_and_std([])


def test_the_summary_re_derives_from_its_per_query_file(multirun, tmp_path):
    summary = aggregate(multirun, tmp_path / "out")
    lines = [json.loads(line) for line in (tmp_path / "out" / PER_QUERY_LINES).read_text().splitlines()]
    assert lines[0] == {"pool": "single", "queries": [list(query) for query in QUERIES]}
    assert lines[1] == {"condition": "infonce", "seed": 0, "pool": "single", "ndcg@5": list(SCORES["infonce", 0])}
    again = summarize(load_per_query(tmp_path / "out" / PER_QUERY_LINES))
    assert again["vs_baseline"] == summary["vs_baseline"] and again["ndcg@5"] == summary["ndcg@5"]
    assert again["verdicts"] == summary["verdicts"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"condition": "hkrag", "seed": 0, "pool": "all", "ndcg@5": [1]}))
    with pytest.raises(AblationError, match="bad.jsonl, line 1: scores without a matching header line of pool all"):
        load_per_query(tmp_path / "bad.jsonl")
