"""Does the tiny Phi3V learn to read? Transcription training on fresh synthetic pages, field read-out on test pages.

Trains every weight of a tiny Phi3V to transcribe a page ("Transcribe the page." -> the page's drawn text,
full causal attention, the generator's prompt and target format) on pages of a synthetic corpus generated for
the purpose (``--pages``; 10,080 pages with the defaults, seed 1, never the test pages' combinations by
construction of the test split), then scores, on the built-in corpus's test pages, how often each field of the
page is transcribed exactly under teacher forcing (every token of the field predicted right given the text
before it). The fields and their strings come from ``pages.jsonl`` (what the generator drew); 8-way fields have
chance 0.125. docs/training.md "A tiny model that reads" records the runs:

    python bench/reading.py --steps 3000 --crop 224 --num-crops 1 --layers 4
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import machine
from tqdm.auto import tqdm

from hkrag.data.collators import IGNORE_INDEX
from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.data.synthetic import STYLES, SyntheticConfig, generate
from hkrag.lvlm import LVLMRequest, PageImage
from hkrag.lvlm.phi3v import phi3_chat
from hkrag.models.phi3v.loading import tiny_phi3v
from hkrag.training.generator import GeneratorCollator, GeneratorExample

INSTRUCTION = "Transcribe the page."
FIELDS = {"title": "{title}", "value": "{value}%", "label": "{label}", "source": "{source}", "year": "{year}",
          "code": "{code}", "page": "P.{page_no}"}
"""Each field's string on a page, from its ``pages.jsonl`` record."""


def example(page, text: str) -> GeneratorExample:
    prompt = phi3_chat(LVLMRequest.user(PageImage(page.image, page.doc_id), INSTRUCTION).messages)
    return GeneratorExample(prompt, [page.image], text)


def field_spans(record: dict, text: str) -> dict[str, tuple[int, int]]:
    """Character span of every field drawn on the page (fields a style does not draw are absent)."""
    spans = {}
    for name, template in FIELDS.items():
        start = text.find(template.format(**record))
        if start >= 0:
            spans[name] = (start, start + len(template.format(**record)))
    return spans


@torch.no_grad()
def readout(model, processor, corpus_dir: Path, records: dict[str, dict], batch: int = 8) -> dict[str, float]:
    """Share of test pages whose field is transcribed exactly under teacher forcing, per field."""
    collator, tokenizer, hits = GeneratorCollator(processor), processor.tokenizer, defaultdict(list)
    for config in [*STYLES, "synfine"]:
        corpus = load_corpus(corpus_dir, config, "test")
        pages = [corpus[i] for i in range(len(corpus))]
        for start in range(0, len(pages), batch):
            chunk = pages[start:start + batch]
            inputs = collator([example(page, page.text) for page in chunk])
            predicted = model(**inputs, use_cache=False).logits[:, :-1].argmax(-1)
            gold = inputs["labels"][:, 1:]
            for row, page in enumerate(chunk):
                keep = gold[row] != IGNORE_INDEX
                ids, guesses, wrong, offset = gold[row][keep].tolist(), predicted[row][keep].tolist(), [], 0
                for token, guess in zip(ids, guesses):
                    end = offset + len(tokenizer.decode([token]))
                    if token != guess:
                        wrong.append((offset, end))
                    offset = end
                for name, (a, b) in field_spans(records[page.doc_id], page.text).items():
                    hits[name].append(not any(x < b and y > a for x, y in wrong))
    return {name: sum(values) / len(values) for name, values in sorted(hits.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=Path, default=Path("data/reading_pages"), help="generated here if missing")
    parser.add_argument("--test", type=Path, default=Path("data/synthetic"), help="the built-in corpus (train.py)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=2, help="LM layers")
    parser.add_argument("--crop", type=int, default=56, help="crop size in px (224 with --num-crops 1: one crop)")
    parser.add_argument("--num-crops", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if not (args.pages / "corpus").is_dir():
        generate(args.pages, SyntheticConfig(seed=1, n_train=0, n_test=0, train_groups_per_style=400,
                                             test_groups_per_style=1, train_fine_groups=80))
    corpus = load_corpus(args.pages / "corpus", "default", "train")
    texts = corpus.texts()
    questions = load_qa(args.test / "qa", "default", "train")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=args.crop, patch_size=14, projection_dim=32)
    model, processor = tiny_phi3v(texts=[q.query for q in questions] + texts[:2000], num_crops=args.num_crops,
                                  seed=args.seed, num_hidden_layers=args.layers, vision_config=vision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    collator = GeneratorCollator(processor)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(args.seed))
    start, bar = time.perf_counter(), tqdm(range(args.steps), desc="transcription")
    for step in bar:
        rows = order[(step * args.batch + torch.arange(args.batch)) % len(corpus)].tolist()
        loss = model(**collator([example(corpus[row], texts[row]) for row in rows]), use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    seconds = time.perf_counter() - start
    model.eval()
    records = {r["doc_id"]: r for r in map(json.loads, (args.test / "pages.jsonl").read_text().splitlines())}
    print(f"machine: {machine()}")
    print(f"{args.steps} steps x {args.batch} pages in {seconds:.0f} s ({len(corpus)} pages, "
          f"{args.steps * args.batch / len(corpus):.1f} epochs), {args.layers} LM layers, "
          f"crops {args.num_crops}x{args.crop}px; last loss {loss.item():.3f} "
          f"(ln vocab {math.log(len(processor.tokenizer)):.2f})")
    scores = readout(model, processor, args.test / "corpus", records)
    print("test read-out:", json.dumps({name: round(share, 3) for name, share in scores.items()}))


if __name__ == "__main__":
    main()
