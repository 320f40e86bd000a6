"""The LLM grader (the paper's judge): rubrics, score parsers, bounded retries, failures, cost, caching, config."""

import importlib.metadata
import sys
from pathlib import Path

import pytest
from _lvlm_fake import Reply, ScriptedServer, completion
from omegaconf import OmegaConf

from hkrag.lvlm.base import LVLMBackend, LVLMHTTPError, LVLMResult, LVLMTimeoutError
from hkrag.rag import grader as judge_module
from hkrag.rag.grader import (
    HKRAG_VERSION,
    NO_REFERENCE,
    Grader,
    ScoreParseError,
    build_grader,
    llamaindex_rubric,
    parse_first_line_score,
    parse_score,
)

CONF = Path(__file__).resolve().parents[1] / "conf" / "judge"
ZERO_COST = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "latency_s": 0.0, "cached_calls": 0}


class Raw:
    """A scripted backend return value passed through as is (not wrapped in an LVLMResult)."""

    def __init__(self, value):
        self.value = value


class ReplyBackend(LVLMBackend):
    """Answers each call with the next scripted reply (an exception is raised, a Raw returned as is)."""

    name = "stub"

    def __init__(self, replies, model="judge-model", cached=False):
        self.replies, self.model, self.cached, self.requests = list(replies), model, cached, []

    def generate(self, requests):
        self.requests.extend(requests)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, Raw):
            return [reply.value]
        return [LVLMResult(reply, [], 10, 2, 0.0, "stop", self.name, self.model, cached=self.cached)]


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("Score: 4", 4),
        ("**4**", 4),
        ("4/5", 4),
        ('{"score": 4}', 4),
        ('{"score": "5", "reason": "matches 2 of the 3 references"}', 5),
        ("Score: 4\nThe candidate adds the year 1995, which is not needed.", 4),
        ("4. The answer is correct but verbose.", 4),
        ("**Score:** 5", 5),
        ("I would give a score of 2 out of 5.", 2),
        ("Score: 3/5", 3),
        ("Score: 4 - correct but verbose", 4),
    ],
)
def test_parse_score(reply, score):
    assert parse_score(reply) == score


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("Score: 7", "7 is not an integer from 1 to 5"),
        ("Score: 0", "0 is not an integer from 1 to 5"),
        ("Score: -1", "-1 is not an integer from 1 to 5"),
        ("Score: 4.5", "4.5 is not an integer"),
        ("Score: 4 or 5", "a range of scores"),
        ("Score: 4-5", "a range of scores"),
        ("Score: 3\nOn reflection, Score: 5", "several different scores: 3, 5"),
        ("**4** ... actually 5/5", "several different scores: 4, 5"),
        ("The answer is essentially right.", "no score found"),
        ("", "no score found"),
    ],
)
def test_parse_score_rejects(reply, reason):
    with pytest.raises(ScoreParseError, match=reason):
        parse_score(reply)


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("4.0\nThe generated answer has the same value, but it is not as concise.", 4.0),  # the template's example
        ("5", 5.0),
        ("4.5\nCorrect.", 4.5),  # fractional, as the template's example "4.0" invites
        ("3.5", 3.5),
        ("\n\n  2.0  \nrelevant but wrong", 2.0),  # the first non-blank line
        ("**4.0**\nfine", 4.0),
        ("Score: 5\nexact", 5.0),
        ("1\nnot relevant", 1.0),
        ("4.0\nA score of 4.0 because it is verbose.", 4.0),  # the reasoning may restate the same score
    ],
)
def test_parse_first_line_score(reply, score):
    assert parse_first_line_score(reply) == score


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("", "no score found (empty reply)"),
        ("   \n \n", "no score found (empty reply)"),
        ("The answer is right.\n5", "no score on the first line 'The answer is right.'"),
        ("4 or 5\nhard to say", "several scores on the first line: 4, 5"),
        ("4.0. The answer is right", "the first line must hold only the score, got '4.0. The answer is right'"),
        ("7\ngreat", "score 7 is outside 1 to 5"),
        ("0.5", "score 0.5 is outside 1 to 5"),
        ("-1", "score -1 is outside 1 to 5"),
        ("4.0\nOn reflection, Score: 2", "several different scores: 4.0, 2"),
    ],
)
def test_parse_first_line_score_rejects(reply, reason):
    with pytest.raises(ScoreParseError) as caught:
        parse_first_line_score(reply)
    assert str(caught.value) == reason


def test_default_rubric_is_the_installed_llamaindex_template():
    """The messages the judge sends are LlamaIndex's CorrectnessEvaluator prompt, formatted by LlamaIndex itself."""
    from llama_index.core.evaluation.correctness import DEFAULT_EVAL_TEMPLATE, DEFAULT_SYSTEM_TEMPLATE

    judge = Grader(ReplyBackend([]))
    question, answer = "What was the revenue in 2019 {in $}?", "It was $3.5 million."
    ours = judge.messages(question, ["3.5 million"], answer)
    theirs = DEFAULT_EVAL_TEMPLATE.format_messages(query=question, reference_answer="3.5 million",
                                                   generated_answer=answer)
    assert [(m.role, m.text) for m in ours] == [(m.role.value, m.content) for m in theirs]
    assert ours[0].text == DEFAULT_SYSTEM_TEMPLATE and "1 is the worst and 5 is the best" in ours[0].text
    version = importlib.metadata.version("llama-index-core")
    assert judge.describe()["rubric"] == "llamaindex"
    assert judge.describe()["rubric_version"].startswith(f"llama-index-core=={version} sha256:")


def test_llamaindex_reference_answer_for_several_or_no_gold_answers():
    judge = Grader(ReplyBackend([]))
    several = judge.messages("Q?", ["1995", "in 1995"], "1995")[1].text
    assert "## Reference Answer\nAny one of these answers is correct:\n- 1995\n- in 1995\n\n" in several
    assert f"## Reference Answer\n{NO_REFERENCE}\n" in judge.messages("Q?", [], "x")[1].text


def test_missing_llamaindex_names_the_extra_and_the_alternative(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_index.core.evaluation.correctness", None)
    llamaindex_rubric.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install -e '\.\[judge\]'.*judge\.rubric=hkrag"):
            Grader(ReplyBackend([]))
        with pytest.raises(ImportError, match="llama-index-core"):
            build_grader({"backend": {"_target_": "no.such.Backend"}})  # fails on the rubric, before any backend
        assert Grader(ReplyBackend([]), rubric="hkrag").describe()["rubric_version"] == HKRAG_VERSION
    finally:
        llamaindex_rubric.cache_clear()


def test_unknown_rubric_is_refused():
    with pytest.raises(ValueError, match=r"judge.rubric must be one of \['hkrag', 'llamaindex'\], got 'vidorag'"):
        Grader(ReplyBackend([]), rubric="vidorag")


@pytest.mark.parametrize("rubric", ["llamaindex", "hkrag"])
def test_correct_iff_score_at_least_4(rubric):
    for reply, score, correct in [("Score: 5", 5, True), ("Score: 4", 4, True), ("Score: 3", 3, False),
                                  ("Score: 1", 1, False)]:
        verdict = Grader(ReplyBackend([reply]), rubric=rubric).judge("Q?", ["a"], "a")
        assert (verdict["score"], verdict["correct"]) == (score, correct)
    for reply, correct in [("4.5", True), ("4.0", True), ("3.9", False)]:  # fractional: LlamaIndex's only
        assert Grader(ReplyBackend([reply])).judge("Q?", ["a"], "a")["correct"] is correct


def test_verdict_fields_and_text_only_greedy_request():
    backend = ReplyBackend(["Score: 4\nCorrect, but verbose."])
    verdict = Grader(backend, rubric="hkrag").judge("What year?", ["1995", "in 1995"], "It was 1995.")
    cost = verdict.pop("cost")
    assert verdict == {"score": 4, "correct": True, "raw": ["Score: 4\nCorrect, but verbose."], "attempts": 1,
                       "error": None, "status": "ok", "model": "judge-model", "rubric": "hkrag",
                       "rubric_version": HKRAG_VERSION, "reused": False}
    assert (cost["calls"], cost["prompt_tokens"], cost["completion_tokens"], cost["cached_calls"]) == (1, 10, 2, 0)
    assert 0 <= cost["latency_s"] < 1
    (request,) = backend.requests
    assert request.settings.temperature == 0 and request.images == []
    prompt = request.messages[-1].text
    assert "What year?" in prompt and "- 1995\n- in 1995" in prompt and "Candidate answer: It was 1995." in prompt


def test_judge_cost_counts_every_call_and_a_reused_verdict_costs_nothing():
    backend = ReplyBackend(["looks fine", "Score: 4", "4.0\nok"], cached=True)
    judge = Grader(backend)
    first = judge.judge("Q?", ["a"], "a")
    assert (first["score"], first["attempts"]) == (4.0, 2)
    assert {k: v for k, v in first["cost"].items() if k != "latency_s"} == {
        "calls": 2, "prompt_tokens": 20, "completion_tokens": 4, "cached_calls": 2}
    again = judge.judge("Q?", ["a"], "a")
    assert (again["score"], again["reused"], again["cost"]) == (4.0, True, ZERO_COST)
    failed = Grader(ReplyBackend([LVLMTimeoutError("no answer within 60 s")])).judge("Q?", ["a"], "a")
    assert (failed["cost"]["calls"], failed["cost"]["prompt_tokens"]) == (1, 0)
    assert Grader(ReplyBackend([])).judge("Q?", ["a"], "")["cost"] == ZERO_COST


def test_unparseable_reply_is_repaired_on_the_next_attempt():
    backend = ReplyBackend(["Looks right to me.", "Score: 5"])
    verdict = Grader(backend, rubric="hkrag", max_attempts=3).judge("Q?", ["a"], "a")
    assert (verdict["score"], verdict["attempts"], verdict["status"]) == (5, 2, "ok")
    assert verdict["raw"] == ["Looks right to me.", "Score: 5"]
    retry = backend.requests[1].messages
    assert [m.role for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2].text == "Looks right to me." and "no score found" in retry[3].text


def test_llamaindex_repair_turn_asks_for_the_score_on_the_first_line():
    backend = ReplyBackend(["The answer is right.", "5.0\nexact"])
    verdict = Grader(backend).judge("Q?", ["a"], "a")
    assert (verdict["score"], verdict["attempts"]) == (5.0, 2)
    assert backend.requests[1].messages[3].text == (
        "Your reply could not be read (no score on the first line 'The answer is right.'). Reply again: the "
        "score alone on the first line (a number from 1 to 5), then your reasoning on a separate line.")


HUGE = "4.0\n" + "very long reasoning " * 1000


@pytest.mark.parametrize(
    ("replies", "status", "error"),
    [
        ([Raw(LVLMResult(None, [], 1, 1, 0.0, "stop", "stub", "m"))] * 3, "unparseable",
         "unparseable after 3 attempts: non-text reply (NoneType)"),
        ([Raw(LVLMResult(b"4.0", [], 1, 1, 0.0, "stop", "stub", "m"))] * 3, "unparseable",
         "unparseable after 3 attempts: non-text reply (bytes)"),
        ([Raw(None)] * 3, "unparseable", "unparseable after 3 attempts: non-text reply (NoneType)"),
        ([""] * 3, "unparseable", "unparseable after 3 attempts: no score found (empty reply)"),
        ([HUGE] * 3, "unparseable",
         f"unparseable after 3 attempts: reply of {len(HUGE)} characters exceeds max_reply_chars=10000"),
        (["4 or 5\nunsure"] * 3, "unparseable", "unparseable after 3 attempts: several scores on the first line: 4, 5"),
        (["4.0\nScore: 2"] * 3, "unparseable", "unparseable after 3 attempts: several different scores: 4.0, 2"),
        (["9\nexcellent"] * 3, "unparseable", "unparseable after 3 attempts: score 9 is outside 1 to 5"),
        (["0\nnothing"] * 3, "unparseable", "unparseable after 3 attempts: score 0 is outside 1 to 5"),
        ([LVLMHTTPError("HTTP 500 after 3 retries", status=500)], "backend_error",
         "LVLMHTTPError: HTTP 500 after 3 retries"),
        (["nope", LVLMTimeoutError("no answer within 60 s")], "backend_error",
         "LVLMTimeoutError: no answer within 60 s"),
    ],
    ids=["none-text", "bytes-text", "no-result", "empty", "huge", "two-scores-first-line", "two-scores-later",
         "above-5", "below-1", "http-500", "timeout-after-garbage"],
)
def test_garbage_from_the_judge_is_a_recorded_wrong_verdict(replies, status, error):
    backend = ReplyBackend(replies)
    verdict = Grader(backend, max_attempts=3).judge("Q?", ["a"], "a")
    assert (verdict["score"], verdict["correct"], verdict["status"], verdict["error"]) == (None, False, status, error)
    assert len(backend.requests) == verdict["attempts"] == len(replies) <= 3  # bounded: nothing hangs
    assert verdict["cost"]["calls"] == len(replies)
    assert all(isinstance(raw, str) and len(raw) < 10_100 for raw in verdict["raw"])  # recorded, huge ones cut
    assert len(verdict["raw"]) == len(replies) - (status == "backend_error")


def test_backend_error_marks_the_sample_judge_failed_and_is_not_cached():
    backend = ReplyBackend([LVLMHTTPError("HTTP 500 after 3 retries", status=500), "Score: 5"])
    judge = Grader(backend)
    failed = judge.judge("Q?", ["a"], "a")
    assert (failed["score"], failed["correct"], failed["status"]) == (None, False, "backend_error")
    assert failed["error"] == "LVLMHTTPError: HTTP 500 after 3 retries"
    assert judge.judge("Q?", ["a"], "a")["score"] == 5  # the next identical sample asks again


def test_identical_samples_are_judged_once():
    backend = ReplyBackend(["Score: 5"])
    judge = Grader(backend)
    first = judge.judge("Q?", ["a"], "a")
    first["raw"].append("mutated by the caller")
    assert judge.judge("Q?", ["a"], "a")["raw"] == ["Score: 5"]
    assert len(backend.requests) == 1


def test_empty_answer_scores_1_without_a_call():
    backend = ReplyBackend([])
    verdict = Grader(backend).judge("Q?", ["a"], "  ")
    assert (verdict["score"], verdict["correct"], verdict["status"], verdict["attempts"]) == (1, False,
                                                                                              "empty_answer", 0)
    assert backend.requests == []


def test_max_attempts_must_be_positive():
    with pytest.raises(ValueError, match="max_attempts and max_reply_chars must be >= 1, got 0 and 10000"):
        Grader(ReplyBackend([]), max_attempts=0)


def test_disabled_judge_is_none():
    assert build_grader(None) is None
    assert build_grader(OmegaConf.to_container(OmegaConf.load(CONF / "none.yaml"))) is None


def judge_config(tmp_path, server):
    """conf/judge/openai.yaml resolved as in a run, pointed at the loopback server."""
    cfg = OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "judge": OmegaConf.load(CONF / "openai.yaml")})
    cfg.judge.backend.update(base_url=server.base_url, api_key_env=None, max_retries=1, timeout_s=5.0)
    cfg.judge.backend.backoff_base_s = 0.01
    return OmegaConf.to_container(cfg.judge, resolve=True)


def test_openai_judge_from_config_over_http(tmp_path):
    with ScriptedServer([Reply(body=completion([("4.0", -0.1), ("\nexact", -0.2)]))]) as server:
        judge = build_grader(judge_config(tmp_path, server))
        verdict = judge.judge("Q?", ["a"], "a")
        again = judge.judge("Q?", ["a"], "a")
    assert (verdict["score"], verdict["correct"], verdict["model"], verdict["rubric"]) == (4.0, True, "qwen-plus",
                                                                                            "llamaindex")
    assert (verdict["cost"]["calls"], verdict["cost"]["prompt_tokens"], verdict["cost"]["completion_tokens"]) == (
        1, 11, 2)
    assert (again["score"], again["reused"], again["cost"]) == (4.0, True, ZERO_COST)
    described = judge.describe()
    assert (described["backend"], described["model"], described["rubric"], described["max_attempts"],
            described["temperature"]) == ("openai", "qwen-plus", "llamaindex", 3, 0.0)
    body = server.received[0].body
    assert body["temperature"] == 0 and not body.get("logprobs")  # the judge asks for text only
    assert len(server.received) == 1
    assert (tmp_path / "judge_cache").is_dir()


def test_server_500s_leave_the_sample_judge_failed(tmp_path):
    with ScriptedServer([Reply(500, {"error": {"message": "overloaded"}})]) as server:
        verdict = build_grader(judge_config(tmp_path, server)).judge("Q?", ["a"], "a")
    assert len(server.received) == 2  # one call plus the backend's single retry; the judge adds none
    assert (verdict["score"], verdict["correct"], verdict["status"]) == (None, False, "backend_error")
    assert "LVLMHTTPError" in verdict["error"] and "500" in verdict["error"]


def test_rubric_module_constants_are_not_a_paraphrase_of_llamaindex():
    """Our own rubric stays an option with its own version; the default is the package's, not ours."""
    assert judge_module.DEFAULT_RUBRIC == "llamaindex"
    assert judge_module.hkrag_rubric().version == HKRAG_VERSION != llamaindex_rubric().version
