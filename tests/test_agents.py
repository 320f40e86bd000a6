"""The agentic generator on a scripted LVLM: every routing decision, cap and failure, and the configs."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from agents import AgenticGenerator, SinglePassGenerator, build_generator
from agents.context import Caps, QueryContext, QueryFailure
from agents.decoupler import read_answered
from agents.prompts import Prompts
from agents.pruner import read_yes_no
from hkrag.lvlm import GenerationSettings, LVLMResult, LVLMTimeoutError, PageImage, TokenLogprob, build_backend
from hkrag.lvlm.scripted import Reply, ScriptedBackend, request_text
from hkrag.rag.records import ROUTES, Query, QueryOutcome

CONF = Path(__file__).resolve().parents[1] / "conf"

# Substrings that identify each prompt of conf/generator/hkrag.yaml.
PRUNER = "Reply with yes or no only"
ANSWER = "Answer the question from the pages above"
SINGLE_PASS = "Answer briefly."
VERIFY = "Final answer:"
SALIENT = "Describe the salient content"
FINE_PRINT = "List the details"
DECOUPLE = "Separate the fine print"
INTEGRATE = "Combine the salient content"

CONFIDENT = Reply("ZEBRA-42", logprobs=math.log(0.99))
UNCERTAIN = Reply("ZEBRA-42", logprobs=-1.0)  # p = 1/e: the maximum of -p log p, so H' = 1


def generator_config(name: str = "hkrag", **overrides) -> dict:
    """A ``conf/generator`` option as Hydra composes it, with overrides merged in."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(overrides=[f"+generator={name}"])
    merged = OmegaConf.merge(cfg.generator, OmegaConf.create(overrides))
    return OmegaConf.to_container(merged, resolve=True)


@pytest.fixture(scope="module")
def hkrag_config() -> dict:
    return generator_config()


def make_pages(n: int) -> list[PageImage]:
    return [PageImage(Image.new("RGB", (8, 8), (40 * i, 0, 0)), f"p{i + 1}") for i in range(n)]


def make_query(n_pages: int = 3) -> Query:
    return Query("q1", "What is the total?", make_pages(n_pages), gold=["42"])


def yes_no(p_yes: float, p_no: float, text: str) -> Reply:
    """A one-token reply ``text`` ("yes" or "no", sampled, not necessarily the likelier) with both probabilities."""
    other = "no" if text == "yes" else "yes"
    chosen, alternative = (p_yes, p_no) if text == "yes" else (p_no, p_yes)
    top = [(text, math.log(chosen)), (f" {other.upper()}", math.log(alternative))]
    return Reply(text, logprobs=math.log(chosen), top=[top])


def backend(*rules, **kwargs) -> ScriptedBackend:
    """Scripted replies for every agent, the given ``rules`` taking precedence."""
    defaults = [
        (PRUNER, yes_no(0.1, 0.9, "no")),
        (ANSWER, CONFIDENT),
        (SINGLE_PASS, CONFIDENT),
        (VERIFY, "verified 42"),
        (SALIENT, "SALIENT-TITLE"),
        (FINE_PRINT, "NOTE"),
        (DECOUPLE, "DETAIL\nAnswers the question: no"),
        (INTEGRATE, "integrated 42"),
    ]
    return ScriptedBackend([*rules, *defaults], **kwargs)


def steps(outcome: QueryOutcome) -> list[str]:
    return [f"{c.agent}.{c.step}" for c in outcome.calls]


def test_pruner_stops_at_first_n_whose_yes_probability_wins(hkrag_config):
    """The probability mass decides over the chosen text: 'yes' at p=0.3 is a no, 'no' at p=0.4 a yes."""
    script = backend(
        ("Do the 1 page(s)", yes_no(0.3, 0.6, text="yes")),
        ("Do the 2 page(s)", yes_no(0.55, 0.4, text="no")),
    )
    outcome = build_generator(hkrag_config, script).answer(make_query(5))
    pruner = [c for c in outcome.calls if c.agent == "pruner"]
    assert [c.decision for c in pruner] == ["no", "yes"]
    assert [c.page_ids for c in pruner] == [["p1"], ["p1", "p2"]]
    assert pruner[1].p_yes == pytest.approx(0.55) and pruner[1].p_no == pytest.approx(0.4)
    assert outcome.kept == ["p1", "p2"]
    assert outcome.calls[2].page_ids == ["p1", "p2"]  # the Judger sees the kept pages
    assert all(r.settings.top_logprobs == 5 for r in script.requests[:2])


def test_pruner_reads_the_text_without_logprobs(hkrag_config):
    script = backend((PRUNER, Reply("Yes, page one suffices.", logprobs=None)))
    outcome = build_generator(hkrag_config, script).answer(make_query(3))
    assert outcome.kept == ["p1"]
    assert outcome.calls[0].decision == "yes" and outcome.calls[0].p_yes is None


def test_pruner_keeps_top_k_when_no_subset_suffices(hkrag_config):
    outcome = build_generator(hkrag_config, backend()).answer(make_query(5))
    assert [c.iteration for c in outcome.calls if c.agent == "pruner"] == [1, 2]  # n = 1 .. k-1
    assert outcome.kept == ["p1", "p2", "p3"]
    assert outcome.retrieved == ["p1", "p2", "p3", "p4", "p5"]


def test_pruner_with_a_single_page_asks_nothing(hkrag_config):
    outcome = build_generator(hkrag_config, backend()).answer(make_query(1))
    assert outcome.kept == ["p1"] and steps(outcome)[0] == "judger.answer"


def test_read_yes_no_hand_computed():
    top = [("▁Yes", math.log(0.5)), ("yes", math.log(0.1)), ("▁No", math.log(0.2))]
    first = TokenLogprob("▁No", math.log(0.2), top=top)
    result = LVLMResult("No", [first], 1, 1, 0.0, "stop", "t", "t")
    reading = read_yes_no(result)
    assert reading.yes and reading.p_yes == pytest.approx(0.6) and reading.p_no == pytest.approx(0.2)
    assert reading.source == "top_k" and reading.probability == pytest.approx(0.75)
    unrelated = LVLMResult("Maybe", [TokenLogprob("Maybe", -0.1)], 1, 1, 0.0, "stop", "t", "t")
    other = read_yes_no(unrelated)  # neither word listed: no mass either way, P(yes) one half
    assert not other.yes and (other.p_yes, other.p_no, other.probability) == (0, 0, 0.5)


@pytest.mark.parametrize(
    ("text", "first", "top", "expected", "masses"),
    [
        # The chosen first token is no yes/no: tiny yes-like alternatives must not turn a sentence into a yes.
        ("The pages do not say.", "The", [("The", -0.05), ("Yes", -4.0)], False, (math.exp(-4.0), 0.0)),
        ("**Yes**, page one.", "**", [("**", -0.2), ("No", -1.9)], True, (0.0, math.exp(-1.9))),
        # The chosen token also listed among its alternatives counts once; distinct alternatives all count.
        ("yes", "yes", [("yes", math.log(0.4)), ("Yes", math.log(0.15)), ("no", math.log(0.45))], True, (0.55, 0.45)),
        ("no", "no", [("no", math.log(0.5)), ("yes", math.log(0.3)), ("YES", math.log(0.1))], False, (0.4, 0.5)),
    ],
    ids=["sentence-with-yes-alternative", "markup-then-yes", "yes-mass-summed", "no-mass-wins"],
)
def test_read_yes_no_reads_the_chosen_token_and_sums_every_alternative(text, first, top, expected, masses):
    logprob = next(lp for token, lp in top if token == first)
    reading = read_yes_no(LVLMResult(text, [TokenLogprob(first, logprob, top=top)], 1, 1, 0.0, "stop", "t", "t"))
    assert reading.yes is expected
    assert (reading.p_yes, reading.p_no) == pytest.approx(masses)


@pytest.fixture(scope="module")
def phi3_tokenizer(reference_phi3v):
    """The real Phi-3-vision tokenizer (SentencePiece pieces, chat template), as the Phi3V backend loads it."""
    from hkrag.models.phi3v import load_processor

    return load_processor(str(reference_phi3v), num_crops=4).tokenizer


def test_greedy_yes_reads_yes_with_the_phi3_tokenizer(phi3_tokenizer):
    """Phi-3's ``▁Yes`` and ``Yes`` are distinct tokens that decode alike; the Phi3V backend lists both as
    "Yes". The greedy ``▁Yes`` (p = 0.50) with ``Yes`` (0.08) against ``▁No`` (0.42) is a yes: 0.58 > 0.42."""
    import torch

    from hkrag.lvlm.local import end_token_ids, token_statistics
    from hkrag.lvlm.phi3v import END_TOKENS, Phi3VBackend

    tok = phi3_tokenizer
    [spaced] = tok.encode("Yes", add_special_tokens=False)
    bare = tok.encode("\nYes", add_special_tokens=False)[-1]
    [no] = tok.encode("No", add_special_tokens=False)
    assert tok.convert_ids_to_tokens([spaced, bare, no]) == ["▁Yes", "Yes", "▁No"]
    assert tok.decode([spaced]) == tok.decode([bare]) == "Yes"
    end = tok.convert_tokens_to_ids("<|end|>")
    first, second = torch.full((1, 32064), -40.0), torch.full((1, 32064), -40.0)
    first[0, [spaced, bare, no]] = torch.tensor([0.50, 0.08, 0.42]).log()
    second[0, end] = 0.0
    chosen = torch.tensor([[spaced, end]])
    phi3 = Phi3VBackend.__new__(Phi3VBackend)  # its answer-building path only, without weights
    phi3.tokenizer, phi3.model, phi3.end_ids = tok, "reference", end_token_ids(tok, END_TOKENS)
    stats = token_statistics([first, second], chosen, top_k=3)
    result = phi3.result(0, chosen[0].tolist(), stats, GenerationSettings(max_new_tokens=4, top_logprobs=3), 1, 0.0)
    assert result.text == "Yes" and [alt for alt, _ in result.tokens[0].top] == ["Yes", "No", "Yes"]
    reading = read_yes_no(result)
    assert reading.yes and reading.p_yes == pytest.approx(0.58, abs=1e-6) and reading.p_no == pytest.approx(0.42)


def test_single_pass_prompt_is_vdocgenerators(phi3_tokenizer):
    """DESIGN §11: the Phi-3 chat template over "<|image_1|>\\n<|image_2|>\\n<|image_3|>\\n{question}\\n Answer
    briefly." with the question stripped of "Query: "; our rendering of the single-pass request is that string."""
    from hkrag.data.opendocvqa import QUERY_PREFIX, QAExample
    from hkrag.lvlm.phi3v import phi3_chat
    from hkrag.tasks.rag import question_text

    question = "What was the revenue in 2019?"
    stripped = question_text(QAExample("q", QUERY_PREFIX + question, ("7",), ("d1",)))
    script = backend()
    build_generator(generator_config("single_pass"), script).answer(Query("q", stripped, make_pages(4)))
    content = f"<|image_1|>\n<|image_2|>\n<|image_3|>\n{question}\n Answer briefly."
    expected = phi3_tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
    assert phi3_chat(script.requests[0].messages) == expected
    assert expected == f"<|user|>\n{content}<|end|>\n<|assistant|>\n"


def test_confident_answer_is_verified_by_the_summarizer(hkrag_config):
    outcome = build_generator(hkrag_config, backend()).answer(make_query(3))
    assert outcome.route == "LQP" and not outcome.failed
    assert steps(outcome) == ["pruner.pruner", "pruner.pruner", "judger.answer", "summarizer.verify"]
    assert outcome.uncertainty == pytest.approx(math.e * -0.99 * math.log(0.99))
    assert outcome.calls[2].uncertainty == outcome.uncertainty and outcome.estimator == "token_plogp"
    assert outcome.answer == "verified 42"


def test_uncertain_answer_mines_fine_print_until_max_iters(hkrag_config):
    """Eq. 7 accumulates: iteration t's prompts hold the notes of iterations 1..t, and the capped loop hands
    the Summarizer the notes of every iteration (not only the last restatement)."""
    count = {"fine_print": 0}

    def notes(_request):
        count["fine_print"] += 1
        return f"NOTE-{count['fine_print']}"

    script = backend((ANSWER, UNCERTAIN), (FINE_PRINT, notes))
    outcome = build_generator(hkrag_config, script).answer(make_query(3))
    assert outcome.route == "HQP" and outcome.uncertainty == pytest.approx(1.0)
    assert outcome.iterations == 3 and outcome.capped == "max_iters" and not outcome.failed
    assert steps(outcome)[3:] == ["decoupler.salient"] + ["decoupler.fine_print", "decoupler.decouple"] * 3 + [
        "summarizer.integrate"
    ]
    prompts = {(c.step, c.iteration): c.prompt for c in outcome.calls}
    assert "Fine-print notes so far:\n(none yet)\n" in prompts["fine_print", 1]
    assert "Fine-print notes so far:\nNOTE-1\nNOTE-2\nLook again" in prompts["fine_print", 3]  # Eq. 7
    assert "Fine-print details:\nNOTE-1\nNOTE-2\nNOTE-3\nSeparate" in prompts["decouple", 3]  # Eq. 8
    assert "Salient content:\nSALIENT-TITLE\n" in prompts["decouple", 3]
    integrate = outcome.calls[-1].prompt
    assert "Salient content:\nSALIENT-TITLE\nFine-print knowledge:\nNOTE-1\nNOTE-2\nNOTE-3\nCombine" in integrate
    assert "Answers the question" not in integrate
    assert outcome.answer == "integrated 42"


def test_decoupler_stops_when_the_fine_print_answers(hkrag_config):
    count = {"decouple": 0}

    def separated(_request):
        count["decouple"] += 1
        return f"DETAIL-{count['decouple']}\nAnswers the question: {'yes' if count['decouple'] == 2 else 'no'}"

    script = backend((ANSWER, UNCERTAIN), (DECOUPLE, separated))
    outcome = build_generator(hkrag_config, script).answer(make_query(3))
    assert outcome.iterations == 2 and outcome.capped is None
    assert [c.decision for c in outcome.calls if c.step == "decouple"] == ["no", "yes"]
    assert "Fine-print details:\nNOTE\nNOTE\nSeparate" in outcome.calls[-2].prompt  # I_d(2): both iterations
    assert outcome.calls[-1].step == "integrate"
    assert "Fine-print knowledge:\nDETAIL-2\nCombine" in outcome.calls[-1].prompt  # the answering I'_d(2)


def test_read_answered_takes_the_last_marker():
    assert read_answered("x\nanswers the question: **Yes**", "Answers the question:") == (True, "x")
    assert read_answered("Answers the question: yes?\nAnswers the question: no", "Answers the question:")[0] is False
    assert read_answered("no marker", "Answers the question:") == (False, "no marker")


@pytest.mark.parametrize("answer", [CONFIDENT, UNCERTAIN], ids=["LQP", "HQP"])
def test_initial_answer_is_never_fed_back(hkrag_config, answer):
    script = backend((ANSWER, answer))
    outcome = build_generator(hkrag_config, script).answer(make_query(3))
    judged = next(i for i, c in enumerate(outcome.calls) if c.agent == "judger")
    later = [request_text(r) for r in script.requests[judged + 1:]]
    assert later and all("ZEBRA-42" not in text for text in later)
    assert outcome.calls[judged].output == "ZEBRA-42"


@pytest.mark.parametrize(
    ("caps", "kwargs", "agent", "reason", "num_calls"),
    [
        ({"max_total_tokens": 250}, {}, "pruner", "max_total_tokens=250", 2),  # ~110 tokens per call
        ({"max_seconds": 0.01}, {"delay_s": 0.02}, "pruner", "max_seconds=0.01", 1),
    ],
    ids=["tokens", "seconds"],
)
def test_caps_fail_the_query_and_keep_its_calls(caps, kwargs, agent, reason, num_calls):
    config = generator_config(caps=caps)
    outcome = build_generator(config, backend((ANSWER, UNCERTAIN), **kwargs)).answer(make_query(3))
    assert outcome.failed and outcome.answer == ""
    assert outcome.failure.startswith(f"{agent}: ") and reason in outcome.failure
    assert outcome.num_calls == num_calls
    restored = QueryOutcome.from_dict(json.loads(json.dumps(outcome.to_dict())))
    assert restored.failure == outcome.failure and restored.num_calls == num_calls


def test_the_context_refuses_a_call_past_max_calls(hkrag_config):
    """The runtime guard behind the build-time check: a call past ``max_calls`` stops the query."""
    caps = Caps.from_config({**hkrag_config["caps"], "max_calls": 1})
    ctx = QueryContext(backend(), Prompts.from_config(hkrag_config["prompts"]), caps, "What?")
    ctx.ask("answer", make_pages(1))
    with pytest.raises(QueryFailure, match=r"^summarizer: call cap reached \(max_calls=1\)$"):
        ctx.ask("verify", make_pages(1))
    assert len(ctx.calls) == 1


@pytest.mark.parametrize(
    ("name", "overrides", "path"),
    [
        ("hkrag", {}, "pruner 2 + judger 1 + decoupler 7 + summarizer 1"),
        ("hkrag", {"top_k": 5, "caps": {"max_iters": 1}}, "pruner 4 + judger 1 + decoupler 3 + summarizer 1"),
        ("no_pruner", {}, "judger 1 + decoupler 7 + summarizer 1"),
        ("no_decoupler", {}, "pruner 2 + summarizer 1"),
        ("no_decoupler", {"pruner": False}, "summarizer 1"),
    ],
    ids=["hkrag", "hkrag-k5-t1", "no_pruner", "no_decoupler", "no_pruner_no_decoupler"],
)
def test_max_calls_below_the_longest_path_is_a_build_error(name, overrides, path):
    """(k−1) + 2 + 2·max_iters + 1 with Pruner and Decoupler; shorter without them. At the minimum the
    longest path (every query HQP, the Decoupler capped, all k pages) runs to its end."""
    minimum = sum(int(part.split()[-1]) for part in path.split(" + "))
    caps = {**overrides.get("caps", {}), "max_calls": minimum - 1}
    if minimum > 1:
        with pytest.raises(ValueError, match=re.escape(
                f"generator caps.max_calls={minimum - 1} is below the {minimum} calls of the longest path ({path}); "
                f"set caps.max_calls >= {minimum}")):
            build_generator(generator_config(name, **{**overrides, "caps": caps}), backend())
    config = generator_config(name, **{**overrides, "caps": {**caps, "max_calls": minimum}})
    outcome = build_generator(config, backend((ANSWER, UNCERTAIN))).answer(make_query(6))
    assert not outcome.failed and outcome.num_calls == minimum


@pytest.mark.parametrize(
    ("name", "estimator", "capabilities", "top_logprobs", "message"),
    [
        ("hkrag", "entropy_exact", {}, 5, "needs per-token entropies, which backend 'scripted' does not report"),
        ("hkrag", "entropy_topk", {"vocab_size": None}, 5, "needs the vocabulary size"),
        ("hkrag", "entropy", {"vocab_size": None}, 5, "needs the vocabulary size"),
        ("hkrag", "entropy_topk", {}, 0, "needs top_logprobs >= 1, got top_logprobs=0"),
        ("hkrag", "entropy", {"exact_entropy": True, "vocab_size": None}, 0, None),
        ("hkrag", "entropy_exact", {"exact_entropy": True}, 5, None),
        ("hkrag", "entropy_topk", {}, 5, None),
        ("no_decoupler", "entropy_exact", {}, 5, None),  # no Judger call, nothing to estimate
    ],
    ids=["exact-unsupported", "topk-no-vocab", "entropy-falls-back-no-vocab", "topk-no-alternatives",
         "entropy-exact-backend", "exact-supported", "topk-supported", "no-judger"],
)
def test_estimator_the_backend_cannot_serve_is_a_build_error(name, estimator, capabilities, top_logprobs, message):
    script = backend()
    for attribute, value in capabilities.items():
        setattr(script, attribute, value)
    config = generator_config(name, estimator=estimator, top_logprobs=top_logprobs)
    if message is None:
        build_generator(config, script)
        return
    with pytest.raises(ValueError, match=f"^generator estimator '{estimator}' .*{re.escape(message)}"):
        build_generator(config, script)
    assert script.requests == []


def test_an_answer_the_estimator_cannot_measure_fails_the_query_naming_the_judger():
    """A server that returned no alternatives for entropy_topk: a failed outcome, not an exception."""
    outcome = build_generator(generator_config(estimator="entropy_topk"), backend()).answer(make_query(1))
    assert outcome.failed and outcome.route == "failed"
    assert outcome.failure.startswith("judger: ValueError: entropy_topk needs top_logprobs alternatives")
    assert outcome.calls[-1].agent == "judger" and outcome.calls[-1].error == outcome.failure.removeprefix("judger: ")


def test_backend_timeout_fails_the_query_naming_the_judger(hkrag_config):
    script = backend((ANSWER, Reply(error=LVLMTimeoutError("no answer within 30 s"))))
    outcome = build_generator(hkrag_config, script).answer(make_query(3))
    assert outcome.failed and outcome.route == "failed"
    assert outcome.failure == "judger: LVLMTimeoutError: no answer within 30 s"
    assert outcome.calls[-1].error == "LVLMTimeoutError: no answer within 30 s" and outcome.calls[-1].agent == "judger"


def test_broken_page_fails_the_query_naming_the_page(hkrag_config):
    query = make_query(3)
    query.pages[1] = PageImage(b"not an image", "broken")
    outcome = build_generator(hkrag_config, backend()).answer(query)
    assert outcome.failed and outcome.failure.startswith("pruner: ImageError: document 'broken'")
    assert [c.page_ids for c in outcome.calls] == [["p1"], ["p1", "broken"]]


def test_zero_pages_fail_unless_no_retrieval_is_allowed(hkrag_config):
    query = make_query(0)
    outcome = build_generator(hkrag_config, backend()).answer(query)
    assert outcome.failed and outcome.failure.startswith("generator: ") and outcome.calls == []
    script = backend()
    allowed = build_generator(generator_config("single_pass", allow_no_pages=True), script).answer(query)
    assert not allowed.failed and allowed.route == "single_pass" and allowed.answer == "ZEBRA-42"
    assert script.requests[0].images == []


def test_single_pass_is_one_call_with_the_top_k_pages():
    generator = build_generator(generator_config("single_pass"), backend())
    assert isinstance(generator, SinglePassGenerator)
    outcome = generator.answer(make_query(5))
    assert steps(outcome) == ["single_pass.single_pass"] and outcome.route == "single_pass"
    assert outcome.kept == ["p1", "p2", "p3"]
    assert outcome.calls[0].prompt == "<page:p1>\n<page:p2>\n<page:p3>\nWhat is the total?\n Answer briefly."


def test_no_pruner_judges_the_fixed_top_k():
    generator = build_generator(generator_config("no_pruner"), backend())
    assert isinstance(generator, AgenticGenerator)
    outcome = generator.answer(make_query(5))
    assert steps(outcome) == ["judger.answer", "summarizer.verify"] and outcome.kept == ["p1", "p2", "p3"]


def test_no_decoupler_verifies_without_a_judger_call():
    """Without the Decoupler both routes end in the same verification: no Judger call, route verify_only."""
    script = backend((ANSWER, UNCERTAIN))
    outcome = build_generator(generator_config("no_decoupler"), script).answer(make_query(2))
    assert outcome.route == "verify_only" and "verify_only" in ROUTES
    assert steps(outcome) == ["pruner.pruner", "summarizer.verify"] and outcome.num_calls == len(script.requests) == 2
    assert outcome.uncertainty is None and outcome.iterations == 0 and outcome.answer == "verified 42"


def test_every_call_shares_the_page_prefix(hkrag_config):
    script = backend((ANSWER, UNCERTAIN))
    build_generator(hkrag_config, script).answer(make_query(3))
    after_pruner = script.requests[2:]
    assert all([p.key for p in r.images] == ["p1", "p2", "p3"] for r in after_pruner)
    assert all(isinstance(r.messages[0].content[i], PageImage) for r in after_pruner for i in range(3))


def test_outcome_round_trips_through_json(hkrag_config):
    outcome = build_generator(hkrag_config, backend((ANSWER, UNCERTAIN))).answer(make_query(3))
    data = json.loads(json.dumps(outcome.to_dict()))
    assert QueryOutcome.from_dict(data) == outcome
    assert data["calls"][0]["p_yes"] == pytest.approx(0.1)


def test_answer_many_keeps_failures_in_order(hkrag_config):
    queries = [make_query(2), make_query(0), make_query(1)]
    outcomes = list(build_generator(hkrag_config, backend()).answer_many(queries))
    assert [o.failed for o in outcomes] == [False, True, False]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kidn": "agentic"}, "unknown keys ['kidn']"),
        ({"kind": "loop"}, "generator.kind='loop': expected one of ['agentic', 'single_pass']"),
        ({"estimator": "vibes"}, "generator.estimator='vibes': expected one of ['token_plogp', 'entropy_exact', "
                                 "'entropy_topk', 'entropy']"),
        ({"caps": {"max_iters": 0}}, "generator.caps.max_iters=0: expected an integer >= 1"),
        ({"caps": {"max_iters": 7}}, "caps.max_calls=16 is below the 19 calls of the longest path"),
        ({"threshold": 1.5}, "generator.threshold=1.5: expected a number >= 0 and <= 1"),
        ({"threshold": -0.1}, "generator.threshold=-0.1: expected a number >= 0 and <= 1"),
        ({"top_logprobs": 21}, "generator.top_logprobs=21: expected an integer >= 0 and <= 20"),
        ({"caps": {"max_new_tokens": {"notes": 0}}}, "generator.caps.max_new_tokens.notes=0: expected an integer >= 1"),
        ({"prompts": {"answer": "Answer {query}"}}, "prompt 'answer' uses unknown placeholders ['query']"),
    ],
)
def test_bad_configs_name_the_problem(hkrag_config, change, message):
    config = copy.deepcopy(hkrag_config)
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_generator(config, backend())


def test_scripted_backend_follows_settings_and_names_unmatched_prompts():
    from hkrag.lvlm import GenerationSettings, LVLMRequest, LVLMResponseError

    script = ScriptedBackend(rules=[{"match": "hello", "text": "a b c", "logprobs": [-1.0, -2.0, -3.0],
                                     "top": [[["a", -1.0], ["z", -2.0]]]}])
    result = script(LVLMRequest.user("hello", settings=GenerationSettings(max_new_tokens=2, top_logprobs=1)))
    assert result.text == "a b" and result.logprobs == [-1.0, -2.0] and result.finish_reason == "length"
    assert result.tokens[0].top == [("a", -1.0)] and result.completion_tokens == 2
    with pytest.raises(LVLMResponseError, match="goodbye"):
        script(LVLMRequest.user("goodbye"))
    assert len(script.requests) == 2


TINY_LVLMS = ["phi3v_tiny", "qwen2_5_vl_tiny"]


@pytest.mark.parametrize("lvlm", TINY_LVLMS)
def test_pipeline_runs_end_to_end_on_tiny_models(lvlm):
    """The real local backends through every agent (random models: whatever they say, the run completes)."""
    settings = {**yaml.safe_load((CONF / "lvlm" / f"{lvlm}.yaml").read_text()), "device": "cpu"}
    config = generator_config(caps={"max_iters": 1, "max_new_tokens": {"yes_no": 2, "answer": 4, "notes": 4}},
                              threshold=0.0)  # every query HQP: the longest path
    with build_backend(settings) as backend:
        outcome = build_generator(config, backend).answer(make_query(2))
    assert not outcome.failed, outcome.failure
    assert outcome.route == "HQP" and outcome.iterations == 1
    assert steps(outcome) == ["pruner.pruner", "judger.answer", "decoupler.salient", "decoupler.fine_print",
                              "decoupler.decouple", "summarizer.integrate"]
    judger = outcome.calls[1]
    assert 0.0 <= judger.uncertainty <= 1.0 and judger.completion_tokens >= 1 and judger.prompt_tokens > 0
