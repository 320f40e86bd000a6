"""The LLM judge: score parser, bounded retries, judge-failed samples, caching, config (hkrag/judge.py)."""

from pathlib import Path

import pytest
from _lvlm_fake import Reply, ScriptedServer, completion
from omegaconf import OmegaConf

from hkrag.judge import RUBRIC_VERSION, Judge, ScoreParseError, build_judge, parse_score
from hkrag.lvlm.base import LVLMBackend, LVLMHTTPError, LVLMResult

CONF = Path(__file__).resolve().parents[1] / "conf" / "judge"


class ReplyBackend(LVLMBackend):
    """Answers each call with the next scripted reply (an exception is raised); records the requests."""

    name = "stub"

    def __init__(self, replies, model="judge-model"):
        self.replies, self.model, self.requests = list(replies), model, []

    def generate(self, requests):
        self.requests.extend(requests)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return [LVLMResult(reply, [], 10, 2, 0.0, "stop", self.name, self.model)]


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


def test_correct_iff_score_at_least_4():
    for reply, correct in [("Score: 5", True), ("Score: 4", True), ("Score: 3", False), ("Score: 1", False)]:
        verdict = Judge(ReplyBackend([reply])).judge("Q?", ["a"], "a")
        assert (verdict["score"], verdict["correct"]) == (int(reply[-1]), correct)


def test_verdict_fields_and_text_only_greedy_request():
    backend = ReplyBackend(["Score: 4\nCorrect, but verbose."])
    verdict = Judge(backend).judge("What year?", ["1995", "in 1995"], "It was 1995.")
    assert verdict == {"score": 4, "correct": True, "raw": ["Score: 4\nCorrect, but verbose."], "attempts": 1,
                       "error": None, "status": "ok", "model": "judge-model", "rubric": RUBRIC_VERSION}
    (request,) = backend.requests
    assert request.settings.temperature == 0 and request.images == []
    prompt = request.messages[-1].text
    assert "What year?" in prompt and "- 1995\n- in 1995" in prompt and "Candidate answer: It was 1995." in prompt


def test_unparseable_reply_is_repaired_on_the_next_attempt():
    backend = ReplyBackend(["Looks right to me.", "Score: 5"])
    verdict = Judge(backend, max_attempts=3).judge("Q?", ["a"], "a")
    assert (verdict["score"], verdict["attempts"], verdict["status"]) == (5, 2, "ok")
    assert verdict["raw"] == ["Looks right to me.", "Score: 5"]
    retry = backend.requests[1].messages
    assert [m.role for m in retry] == ["system", "user", "assistant", "user"]
    assert retry[2].text == "Looks right to me." and "no score found" in retry[3].text


def test_unparseable_after_max_attempts_counts_wrong_and_stops():
    backend = ReplyBackend(["meh", "Score: 9", "Score: 5"])
    verdict = Judge(backend, max_attempts=2).judge("Q?", ["a"], "a")
    assert len(backend.requests) == 2
    assert (verdict["score"], verdict["correct"], verdict["attempts"], verdict["status"]) == (None, False, 2,
                                                                                              "unparseable")
    assert verdict["raw"] == ["meh", "Score: 9"]
    assert verdict["error"] == "unparseable after 2 attempts: score 9 is not an integer from 1 to 5"


def test_backend_error_marks_the_sample_judge_failed_and_is_not_cached():
    backend = ReplyBackend([LVLMHTTPError("HTTP 500 after 3 retries", status=500), "Score: 5"])
    judge = Judge(backend)
    failed = judge.judge("Q?", ["a"], "a")
    assert (failed["score"], failed["correct"], failed["status"]) == (None, False, "backend_error")
    assert failed["error"] == "LVLMHTTPError: HTTP 500 after 3 retries"
    assert judge.judge("Q?", ["a"], "a")["score"] == 5  # the next identical sample asks again


def test_identical_samples_are_judged_once():
    backend = ReplyBackend(["Score: 5"])
    judge = Judge(backend)
    first = judge.judge("Q?", ["a"], "a")
    first["raw"].append("mutated by the caller")
    assert judge.judge("Q?", ["a"], "a")["raw"] == ["Score: 5"]
    assert len(backend.requests) == 1


def test_empty_answer_scores_1_without_a_call():
    backend = ReplyBackend([])
    verdict = Judge(backend).judge("Q?", ["a"], "  ")
    assert (verdict["score"], verdict["correct"], verdict["status"], verdict["attempts"]) == (1, False,
                                                                                              "empty_answer", 0)
    assert backend.requests == []


def test_max_attempts_must_be_positive():
    with pytest.raises(ValueError, match="max_attempts must be >= 1, got 0"):
        Judge(ReplyBackend([]), max_attempts=0)


def test_disabled_judge_is_none():
    assert build_judge(None) is None
    assert build_judge(OmegaConf.to_container(OmegaConf.load(CONF / "none.yaml"))) is None


def judge_config(tmp_path, server):
    """conf/judge/openai.yaml resolved as in a run, pointed at the loopback server."""
    cfg = OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "judge": OmegaConf.load(CONF / "openai.yaml")})
    cfg.judge.backend.update(base_url=server.base_url, api_key_env=None, max_retries=1, timeout_s=5.0)
    cfg.judge.backend.backoff_base_s = 0.01
    return OmegaConf.to_container(cfg.judge, resolve=True)


def test_openai_judge_from_config_over_http(tmp_path):
    with ScriptedServer([Reply(body=completion([("Score:", -0.1), (" 5", -0.2)]))]) as server:
        judge = build_judge(judge_config(tmp_path, server))
        verdict = judge.judge("Q?", ["a"], "a")
        assert judge.judge("Q?", ["a"], "a") == verdict
    assert (verdict["score"], verdict["correct"], verdict["model"]) == (5, True, "qwen-plus")
    assert judge.describe() == {"backend": "openai", "model": "qwen-plus", "rubric": RUBRIC_VERSION,
                                "max_attempts": 3, "temperature": 0.0}
    assert server.received[0].body["temperature"] == 0
    assert len(server.received) == 1
    assert (tmp_path / "judge_cache").is_dir()


def test_server_500s_leave_the_sample_judge_failed(tmp_path):
    with ScriptedServer([Reply(500, {"error": {"message": "overloaded"}})]) as server:
        verdict = build_judge(judge_config(tmp_path, server)).judge("Q?", ["a"], "a")
    assert len(server.received) == 2  # one call plus the backend's single retry; the judge adds none
    assert (verdict["score"], verdict["correct"], verdict["status"]) == (None, False, "backend_error")
    assert "LVLMHTTPError" in verdict["error"] and "500" in verdict["error"]
