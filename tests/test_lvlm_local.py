"""Local LVLM backends (tiny random Phi3V and Qwen2.5-VL): probabilities, batching, feature reuse, pages."""

from __future__ import annotations

import inspect
import io
import math
from pathlib import Path

import pytest
import torch
from _lvlm_fake import Reply, ScriptedServer, completion
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from transformers import DynamicCache

from hkrag.lvlm import (
    GenerationSettings,
    LVLMRequest,
    LVLMResponseError,
    Message,
    PageImage,
    backend_class,
    build_backend,
    uncertainty,
)
from hkrag.lvlm.base import ImageError
from hkrag.lvlm.feature_cache import FeatureCache
from hkrag.lvlm.local import cut_at_stop, token_statistics
from hkrag.lvlm.openai_backend import OpenAIBackend
from hkrag.lvlm.phi3v import Phi3VBackend, phi3_chat
from hkrag.lvlm.prefix_cache import PrefixCache, PromptLayout
from hkrag.lvlm.qwen2_5_vl import Qwen2_5_VLBackend
from hkrag.models.qwen2_5_vl import build_qwen_offline_tokenizer, tiny_qwen2_5_vl_config

BACKENDS = {backend.name: backend for backend in (Phi3VBackend, Qwen2_5_VLBackend)}
KINDS = tuple(BACKENDS)
CONF = Path(__file__).resolve().parents[1] / "conf" / "lvlm"
GREEDY = GenerationSettings(max_new_tokens=6, top_logprobs=3)


def tiny(kind: str, **settings) -> object:
    """A tiny backend; Qwen pages are bounded to 4..64 tokens (as conf/lvlm/qwen2_5_vl_tiny.yaml) for speed."""
    if kind == "qwen2_5_vl":
        settings = {"min_pixels": 4 * 784, "max_pixels": 64 * 784, **settings}
    return BACKENDS[kind](base="tiny", seed=0, **settings)


def page(key: str, size: tuple[int, int], colour: tuple[int, int, int]) -> PageImage:
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    return PageImage(image, key)


@pytest.fixture(scope="module")
def pages() -> list[PageImage]:
    return [page("doc-a", (100, 80), (200, 30, 30)), page("doc-b", (300, 120), (30, 30, 200)),
            page("doc-c", (60, 140), (30, 160, 30))]


def requests(pages: list[PageImage]) -> list[LVLMRequest]:
    """Prompts of different lengths: no page, one page, three pages with a system turn."""
    return [
        LVLMRequest.user("Answer the question with a short phrase.", settings=GREEDY),
        LVLMRequest.user(pages[0], "What is shown in this image?", settings=GREEDY),
        LVLMRequest(
            [Message("system", ["Answer briefly."]), Message("user", [pages[1], "Is it", pages[2], pages[0], "red?"])],
            GREEDY,
        ),
    ]


def reference_logits(backend, request: LVLMRequest, generated: list[int]) -> torch.Tensor:
    """Logits of a plain forward pass over prompt + generated tokens, inputs built by the model's processor
    (pixel values, not cached features): (len(generated), V) at the positions that predicted them."""
    images = [p.load() for p in request.images]
    if backend.name == "phi3v":
        inputs = backend.processor(backend.prompt(request), images or None)
    else:
        inputs = backend.processor(text=[backend.prompt(request)], images=images or None, return_tensors="pt")
    prompt_length = inputs["input_ids"].shape[1]
    extra = torch.tensor([generated])
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], 1)
    with torch.no_grad():
        logits = backend.lm(**inputs).logits[0]
    return logits[prompt_length - 1 : prompt_length - 1 + len(generated)].float()


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_are_log_softmax_of_the_models_own_logits(kind, pages):
    backend = tiny(kind)
    request = requests(pages)[2]
    res = backend(request)
    assert res.finish_reason == "length" and len(res.tokens) == GREEDY.max_new_tokens == res.completion_tokens
    generated = [t.token_id for t in res.tokens]
    log_p = torch.log_softmax(reference_logits(backend, request, generated), -1)
    expected = log_p.gather(1, torch.tensor(generated)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.logprobs), expected, atol=1e-4, rtol=0)
    entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(torch.tensor([t.entropy for t in res.tokens]), entropy, atol=1e-4, rtol=0)
    for token in res.tokens:  # greedy: the chosen token is the best alternative; alternatives sorted
        assert token.top[0][1] == pytest.approx(token.logprob, abs=1e-6)
        assert [lp for _, lp in token.top] == sorted((lp for _, lp in token.top), reverse=True)
    assert res.vocab_size == log_p.shape[-1] == backend.vocab_size and backend.exact_entropy
    assert "".join(t.token for t in res.tokens) == res.text
    assert 0 < uncertainty(res, "entropy_exact").value <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_equals_one_by_one(kind, pages):
    backend = tiny(kind, batch_size=4, feature_cache_size=0)
    batch = requests(pages)
    together = backend.generate(batch)
    alone = [backend(r) for r in batch]
    assert len({r.prompt_tokens for r in together}) == 3  # really different lengths, so padded
    for a, b in zip(together, alone):
        assert a.text == b.text
        assert a.prompt_tokens == b.prompt_tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_feature_reuse_changes_nothing_and_runs_the_vision_tower_once_per_page(kind, pages):
    calls = {}
    results = {}
    for size in (0, 8):
        backend = tiny(kind, feature_cache_size=size)
        tower = backend.lm.model.vision_embed_tokens.img_processor if kind == "phi3v" else backend.lm.model.visual
        calls[size] = 0
        tower.register_forward_hook(lambda *_, size=size: calls.__setitem__(size, calls[size] + 1))
        first = backend(LVLMRequest.user(pages[0], pages[1], "What is the title?", settings=GREEDY))
        second = backend(LVLMRequest.user(pages[0], pages[1], "Is the document sufficient?", settings=GREEDY))
        results[size] = (first, second)
    assert calls == {0: 4, 8: 2}
    for plain, reused in zip(results[0], results[8]):
        assert plain.text == reused.text
        assert plain.logprobs == reused.logprobs


def agent_like_calls(pages: list[PageImage]) -> list[LVLMRequest]:
    """Pages first, then text: the Pruner's pages 1..2, an answer and a verification on all three, other
    pages, a text-only call, the first page again after its entry was extended."""
    a, b, c = pages
    calls = [([a], "Do the 1 page(s) suffice?"), ([a, b], "Do the 2 page(s) suffice?"), ([a, b, c], "Answer:"),
             ([a, b, c], "Verify the answer."), ([b, c], "Answer:"), ([a, b, c], "Verify again."),
             ([], "No page."), ([a], "Do the 1 page(s) suffice?")]
    return [LVLMRequest.user(*shown, text, settings=GREEDY) for shown, text in calls]


def prefill_lengths(backend) -> list[int]:
    """Records how many tokens each forward pass of the language model takes."""
    lengths = []
    backend.lm.get_input_embeddings().register_forward_hook(lambda _, __, out: lengths.append(out.shape[1]))
    return lengths


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_reuse_gives_identical_answers_and_prefills_only_the_new_tokens(kind, pages):
    plain, reused = tiny(kind, prefix_cache_size=0), tiny(kind, prefix_cache_size=8)
    lengths = prefill_lengths(reused)
    firsts = []
    for request in agent_like_calls(pages):
        expected, lengths[:] = plain(request), []
        got = reused(request)
        firsts.append(lengths[0])
        assert [t.token_id for t in got.tokens] == [t.token_id for t in expected.tokens]
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)
        assert [t.entropy for t in got.tokens] == pytest.approx([t.entropy for t in expected.tokens], abs=1e-5)
        assert got.prompt_tokens == expected.prompt_tokens  # the whole prompt, reused or not
    hit = [False, True, True, True, False, True, False, True]
    assert (reused.prefixes.hits, reused.prefixes.misses) == (5, 3)
    prompts = [reused.layout(reused.prepare([r])) for r in agent_like_calls(pages)]
    for prompt, first, was_hit in zip(prompts, firsts, hit):
        assert (first < len(prompt)) == was_hit
    a_b_c, verify = prompts[2], prompts[3]
    assert firsts[3] == len(verify) - a_b_c.spans[-1][1]  # only the text after the third page
    assert (plain.prefixes.hits, plain.prefixes.misses, len(plain.prefixes)) == (0, 0, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_batches_do_not_use_the_prefix_cache(kind, pages):
    backend = tiny(kind, prefix_cache_size=8)
    backend.generate(agent_like_calls(pages)[:3])
    assert (backend.prefixes.hits, backend.prefixes.misses, len(backend.prefixes)) == (0, 0, 0)


def test_another_page_or_num_crops_never_hits(pages):
    backend = tiny("phi3v", prefix_cache_size=8)
    backend(LVLMRequest.user(pages[0], pages[1], "What?", settings=GREEDY))
    backend(LVLMRequest.user(pages[2], pages[1], "What?", settings=GREEDY))  # same tokens, another first page
    assert (backend.prefixes.hits, backend.prefixes.misses) == (0, 2)
    backend.processor.image_processor.num_crops = 1
    other = tiny("phi3v", num_crops=1, prefix_cache_size=0)
    request = LVLMRequest.user(pages[0], pages[1], "Where?", settings=GREEDY)
    got, expected = backend(request), other(request)
    assert (backend.prefixes.hits, backend.prefixes.misses) == (0, 3)
    assert got.prompt_tokens == expected.prompt_tokens and got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def layout(ids: list[int], *pages: tuple[str, int, int]) -> PromptLayout:
    return PromptLayout(torch.tensor(ids), tuple(key for key, _, _ in pages), tuple((s, e) for _, s, e in pages))


def test_prompt_layouts_share_tokens_up_to_the_first_difference_in_ids_or_pages():
    mine = layout([1, 2, -1, -1, 3, -1, 4, 5], ("a", 2, 4), ("b", 5, 6))
    assert mine.shared_length(layout([1, 2, -1, -1, 3, -1, 4, 9], ("a", 2, 4), ("b", 5, 6))) == 7
    assert mine.shared_length(layout([1, 2, -1, -1, 3, -1, 4], ("a", 2, 4), ("c", 5, 6))) == 5
    assert mine.shared_length(layout([1, 2, -1, -1], ("z", 2, 4))) == 2
    assert mine.whole_pages(3) == (2, 0) and mine.whole_pages(5) == (5, 1) and mine.whole_pages(8) == (8, 2)
    head = mine.head(5)
    assert (head.ids.tolist(), head.pages, head.spans) == ([1, 2, -1, -1, 3], ("a",), ((2, 4),))


def key_values(length: int, value: float) -> DynamicCache:
    """A one-layer cache whose position ``i`` holds ``value + i``."""
    states = (value + torch.arange(length, dtype=torch.float32)).view(1, 1, length, 1)
    return DynamicCache([(states, states.clone())])


def test_prefix_cache_is_a_bounded_lru_that_keeps_the_longest_prompt():
    cache = PrefixCache(2)
    first = layout([1, -1, -1, 2, 3], ("a", 1, 3))
    longer = layout([1, -1, -1, 2, -1, 4], ("a", 1, 3), ("b", 4, 5))
    cache.store(first, key_values(5, 0.0))
    cache.store(longer, key_values(6, 10.0))  # extends the first: replaces it
    assert [prefix.pages for prefix, _ in cache.entries.values()] == [("a", "b")]
    reuse = cache.lookup(layout([1, -1, -1, 2, 7, 7], ("a", 1, 3)))
    assert (reuse.tokens, reuse.pages) == (4, 1)
    assert reuse.key_values[0][0].flatten().tolist() == [10.0, 11.0, 12.0, 13.0]
    cache.store(first, key_values(5, 0.0))  # held by the longer entry: nothing new
    assert len(cache) == 1
    assert cache.lookup(layout([1, -1, -1, 2], ("b", 1, 3))) is None  # same ids, another page
    assert cache.lookup(layout([1, -1], ("a", 1, 2))) is None  # nothing before its last token is a whole page
    for key in "cd":
        cache.store(layout([5, -1, 6], (key, 1, 2)), key_values(3, 0.0))
    assert [prefix.pages for prefix, _ in cache.entries.values()] == [("c",), ("d",)]
    assert (cache.hits, cache.misses, cache.reused_tokens) == (1, 2, 4)
    with pytest.raises(ValueError, match="prefix_cache_size must be >= 0, got -1"):
        PrefixCache(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_undecodable_page_raises_image_error_naming_the_page(kind):
    backend = tiny(kind)
    with pytest.raises(ImageError, match="doc-broken"):
        backend(LVLMRequest.user(PageImage(b"not an image at all", "doc-broken"), "What is shown?"))


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_page_is_resized_within_bounds(kind):
    backend = tiny(kind)
    buffer = io.BytesIO()
    Image.new("RGB", (20000, 300), (255, 255, 255)).save(buffer, format="PNG")
    res = backend(LVLMRequest.user(PageImage(buffer.getvalue(), "doc-wide"), "Title?",
                                   settings=GenerationSettings(max_new_tokens=2)))
    features = backend.page(PageImage(None, "doc-wide"))  # cached by key: no decode
    tokens = len(features) if kind == "phi3v" else len(features[0])
    if kind == "phi3v":  # 4 crops of 56 px in one row: (1*4 + 1)*4 + 1 + 2*2 image tokens
        assert tokens == 25
    else:  # smart_resize to max_pixels: height clamps to 28 px, width 65 * 28 px -> 2 x 130 patches, 2x2-merged
        assert tokens == 65
    assert res.prompt_tokens > tokens and res.completion_tokens == 2


def test_phi3_chat_format_numbers_images_across_the_conversation(pages):
    messages = [
        Message("system", ["Be brief."]),
        Message("user", [pages[0], "First?"]),
        Message("assistant", ["Yes."]),
        Message("user", [pages[1], pages[2], "Second?"]),
    ]
    assert phi3_chat(messages) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\n<|image_1|>\nFirst?<|end|>\n<|assistant|>\nYes.<|end|>\n"
        "<|user|>\n<|image_2|>\n<|image_3|>\nSecond?<|end|>\n<|assistant|>\n"
    )


def test_qwen_prompt_uses_the_chat_template_with_one_pad_per_page(pages):
    backend = tiny("qwen2_5_vl")
    prompt = backend.prompt(LVLMRequest.user(pages[0], "What?", pages[1]))
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>What?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_cuts_text_and_tokens_together(kind, pages):
    backend = tiny(kind)
    free = backend(LVLMRequest.user(pages[0], "What?", settings=GenerationSettings(max_new_tokens=8)))
    position = next(i for i in range(1, len(free.text)) if free.text[i].strip())
    stop = free.text[position : position + 2]
    cut = backend(LVLMRequest.user(pages[0], "What?", settings=GenerationSettings(max_new_tokens=8, stop=(stop,))))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    kept = "".join(t.token for t in cut.tokens)
    assert kept.startswith(cut.text) and len(kept) - len(cut.tokens[-1].token) < len(cut.text) + (not cut.text)
    assert cut.logprobs == pytest.approx(free.logprobs[: len(cut.tokens)], abs=1e-5)
    assert len(cut.tokens) <= cut.completion_tokens < free.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_end_token_ends_the_answer(kind):
    backend = tiny(kind)
    end = backend.end_ids[0]
    vocab = 5
    stats = token_statistics([torch.zeros(1, vocab)] * 4, torch.zeros(1, 4, dtype=torch.long), 0)
    ids = [backend.tokenizer.convert_tokens_to_ids(t) for t in backend.tokenizer.tokenize("red blue")]
    res = backend.result(0, [*ids, end, end], stats, GenerationSettings(max_new_tokens=4), 7, 0.5)
    assert (res.finish_reason, res.completion_tokens, res.text) == ("stop", len(ids) + 1, "red blue")
    assert [t.token_id for t in res.tokens] == ids
    assert res.tokens[0].logprob == pytest.approx(-math.log(vocab))


def step_logits(probs: list[float], vocab: int = 4) -> list[torch.Tensor]:
    """One step per probability: token 0 has it, the other ``vocab - 1`` share the rest."""
    return [torch.tensor([[math.log(p)] + [math.log((1 - p) / (vocab - 1))] * (vocab - 1)]) for p in probs]


@pytest.mark.parametrize("end_text", ["vocabulary", ""])
@pytest.mark.parametrize("kind", KINDS)
def test_the_same_answer_gets_the_same_uncertainty_in_process_and_over_http(kind, end_text):
    """The end-token rule: a vLLM-style response listing the end token (as its text, or empty) gives the
    H′ of the local backend, which never counts it."""
    backend = tiny(kind)
    end = backend.end_ids[0]
    ids = [backend.tokenizer.convert_tokens_to_ids(t) for t in backend.tokenizer.tokenize("red blue")]
    probs = [0.9, 0.5, 0.3, 0.7, 0.2, 0.8][: len(ids)] + [0.6]  # the end token's p = 0.6 last
    stats = token_statistics(step_logits(probs), torch.zeros(1, len(probs), dtype=torch.long), 0)
    local = backend.result(0, [*ids, end], stats, GenerationSettings(max_new_tokens=8), 7, 0.5)
    end_token = backend.tokenizer.convert_ids_to_tokens(end) if end_text else ""
    served = [(t.token, t.logprob) for t in local.tokens] + [(end_token, float(stats.logprobs[0, -1]))]
    body = completion(served)
    body["choices"][0]["message"]["content"] = local.text
    with ScriptedServer([Reply(body=body)]) as server:
        remote = OpenAIBackend("m", server.base_url, api_key_env=None)(LVLMRequest.user("What colour?"))
    assert (remote.text, remote.finish_reason, remote.logprobs) == (local.text, "stop", local.logprobs)
    assert uncertainty(remote).value == uncertainty(local).value == pytest.approx(
        math.e * sum(-p * math.log(p) for p in probs[:-1]) / len(ids), abs=1e-6)


@pytest.mark.parametrize("poison,value", [(0, math.nan), (2, math.nan), (1, math.inf)])
def test_nan_logits_are_a_response_error(poison, value):
    """NaN at the chosen token, NaN elsewhere in the distribution, +inf (log_softmax then gives NaN)."""
    backend = tiny("phi3v")
    logits = step_logits([0.5, 0.5, 0.5])
    logits[1][0, poison] = value
    stats = token_statistics(logits, torch.zeros(1, 3, dtype=torch.long), 2)
    with pytest.raises(LVLMResponseError, match="logits are NaN at generated token 1 .request 0 of the batch."):
        backend.result(0, [5, 6, 7], stats, GenerationSettings(max_new_tokens=3), 7, 0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_is_reproducible(kind, pages):
    backend = tiny(kind, prefix_cache_size=0)  # the second call would reuse the first's prefix: equal within 1e-5
    settings = GenerationSettings(max_new_tokens=6, temperature=1.0, seed=3)
    first, second = (backend(LVLMRequest.user(pages[0], "What?", settings=settings)) for _ in range(2))
    assert first.text == second.text and first.logprobs == second.logprobs


def test_token_statistics_match_hand_computed_values():
    logits = [torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]]), torch.tensor([[0.0, 0.0, 0.0]])]
    stats = token_statistics(logits, torch.tensor([[1, 2]]), top_k=2)
    torch.testing.assert_close(stats.logprobs, torch.tensor([[math.log(0.25), -math.log(3)]]))
    torch.testing.assert_close(stats.entropies, torch.tensor([[1.5 * math.log(2), math.log(3)]]))
    assert stats.top_ids[0, 0].tolist() == [0, 1] and stats.vocab_size == 3


def test_masked_logits_add_nothing_to_the_entropy():
    logits = torch.tensor([[0.0, 0.0, -math.inf]])
    stats = token_statistics([logits], torch.tensor([[2]]), top_k=0)
    assert stats.entropies.item() == pytest.approx(math.log(2)) and stats.logprobs.item() == -math.inf


def test_cut_at_stop_keeps_the_straddling_token():
    assert cut_at_stop(["Par", "is.", "\nNext"], ["\n"]) == ("Paris.", 2, 3)
    assert cut_at_stop(["Par", "is.\nN", "ext"], ["\n", "ext"]) == ("Paris.", 2, 2)
    assert cut_at_stop(["a", "b"], ["zz"]) == ("ab", 2, None)
    assert cut_at_stop(["END", "x"], ["END"]) == ("", 0, 1)


def test_feature_cache_is_a_bounded_lru():
    cache = FeatureCache(2)
    computed = []
    for key in ["a", "b", "a", "c", "b"]:
        cache.get(key, lambda key=key: computed.append(key) or key.upper())
    assert computed == ["a", "b", "c", "b"]  # "b" was evicted by "c" ("a" had been used more recently)
    assert (cache.hits, cache.misses, len(cache)) == (1, 4, 2)
    assert len(FeatureCache(0).entries) == 0
    with pytest.raises(ValueError, match="feature_cache_size must be >= 0, got -1"):
        FeatureCache(-1)


def lvlm_config(path: Path) -> DictConfig:
    """conf/lvlm/<name>.yaml as eval.py composes it (a config may extend another through its ``defaults``)."""
    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        return compose("eval", [f"lvlm={path.stem}"]).lvlm


def backend_configs() -> dict[str, dict]:
    """Every LVLM config: conf/lvlm/*.yaml and the judges' ``backend`` blocks (conf/judge/*.yaml)."""
    configs = {path.stem: lvlm_config(path) for path in sorted(CONF.glob("*.yaml"))}
    judges = {f"judge-{path.stem}": OmegaConf.load(path).backend
              for path in sorted((CONF.parent / "judge").glob("*.yaml"))}
    return {name: OmegaConf.to_container(cfg) for name, cfg in {**configs, **judges}.items() if cfg is not None}


@pytest.mark.parametrize("name,cfg", backend_configs().items(), ids=list(backend_configs()))
def test_lvlm_configs_match_the_constructors(name, cfg):
    settings = {key: value for key, value in cfg.items() if key != "_target_"}
    inspect.signature(backend_class(cfg["_target_"])).bind(**settings)
    if cfg.get("base") == "tiny":
        assert build_backend(cfg).generate([]) == []


def test_qwen_config_refuses_rope_sections_that_do_not_span_half_a_head():
    tokenizer = build_qwen_offline_tokenizer()
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 3\] must sum to half the head dimension \(64"):
        tiny_qwen2_5_vl_config(tokenizer, hidden_size=2048, num_attention_heads=16)
    rope = dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])
    config = tiny_qwen2_5_vl_config(tokenizer, hidden_size=2048, num_attention_heads=16, rope_parameters=rope)
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
