"""Can the tiny Phi3V's vision path learn to read? A word-naming probe (issue 23, "a tiny model that reads").

Trains the tiny model's image embedding (CLIP tower + HD merge + projection, all weights) and a linear head
to name which of the eight ``SOURCES`` words is drawn on an otherwise blank synthetic page, then scores fresh
pages. Two axes separate what limits reading:

- ``--position fixed``: the word is always drawn at one place, so a position-specific read-out (``flat``: the
  head sees every image token) only has to tell glyphs apart where they always are;
- ``--position random``: the word lands anywhere, so the features must recognise glyphs wherever the
  non-overlapping 14-px patch grid cuts them (``max``/``mean`` pooling over image tokens).

docs/training.md "What limits the tiny reader" records the figures:

    python bench/vision_readout.py --position fixed --pool flat
    python bench/vision_readout.py --position random --pool max
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from common import machine
from PIL import Image, ImageDraw, ImageFont

from hkrag.data.synthetic import CODES, LABELS, PAPER, REFERENCE_SIZE, SOURCES, TITLES, YEARS
from hkrag.models.phi3v.loading import tiny_phi3v

INK = (25, 25, 25)
VOCABULARIES = {
    "sources": list(SOURCES),
    "all": [*TITLES, *LABELS, *SOURCES, *CODES, *YEARS, *(f"{value}%" for value in range(10, 100))],
}
"""``sources``: 8 words; ``all``: every word and headline value the built-in pages draw (130)."""


def draw_word(rng: random.Random, words: list[str], sizes: list[int], position: str) -> tuple[Image.Image, int]:
    """A blank page with one of ``words`` drawn at one of ``sizes`` px, at a fixed or a random place; its index."""
    label, size = rng.randrange(len(words)), rng.choice(sizes)
    page = Image.new("RGB", REFERENCE_SIZE, PAPER)
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=size)
    width = int(draw.textlength(words[label], font=font))
    x, y = (20, 60) if position == "fixed" else (rng.randint(4, REFERENCE_SIZE[0] - width - 4),
                                                  rng.randint(4, REFERENCE_SIZE[1] - size - 4))
    draw.text((x, y), words[label], font=font, fill=INK)
    return page, label


class WordProbe(torch.nn.Module):
    """The tiny model's image embedding, pooled over its image tokens, then a linear head over the words."""

    def __init__(self, num_crops: int, pool: str, vision_config: dict | None, seed: int, classes: int) -> None:
        super().__init__()
        overrides = {"vision_config": vision_config} if vision_config else {}
        model, self.processor = tiny_phi3v(texts=["probe"], num_crops=num_crops, seed=seed, **overrides)
        self.embed = model.model.vision_embed_tokens
        tokens = int(self.processor.image_processor([Image.new("RGB", REFERENCE_SIZE)],
                                                    return_tensors="pt")["num_img_tokens"][0])
        self.pool, self.hidden = pool, model.config.hidden_size
        width = self.hidden * (tokens if pool == "flat" else 1)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, pages: list[Image.Image]) -> torch.Tensor:
        vision = self.processor.image_processor(pages, return_tensors="pt")
        tokens = self.embed(vision["pixel_values"], vision["image_sizes"]).reshape(len(pages), -1, self.hidden)
        pooled = {"flat": lambda t: t.flatten(1), "max": lambda t: t.max(1).values, "mean": lambda t: t.mean(1)}
        return self.head(pooled[self.pool](tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--position", choices=("fixed", "random"), default="random")
    parser.add_argument("--pool", choices=("flat", "max", "mean"), default="max")
    parser.add_argument("--size", default="30", help="font size(s) in px, comma-separated (fine print is 14)")
    parser.add_argument("--vocabulary", choices=sorted(VOCABULARIES), default="sources")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--crop", type=int, default=56, help="crop size in px (224 with --num-crops 1: one crop)")
    parser.add_argument("--num-crops", type=int, default=12)
    parser.add_argument("--vision-width", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    vision = dict(hidden_size=args.vision_width, intermediate_size=2 * args.vision_width, num_hidden_layers=2,
                  num_attention_heads=max(2, args.vision_width // 16), image_size=args.crop, patch_size=14,
                  projection_dim=32)
    words, sizes = VOCABULARIES[args.vocabulary], [int(size) for size in args.size.split(",")]
    probe = WordProbe(args.num_crops, args.pool, vision, args.seed, len(words))
    optimizer = torch.optim.AdamW(probe.parameters(), lr=args.lr)
    rng, held_out = random.Random(args.seed), random.Random(args.seed + 1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        pages, labels = zip(*(draw_word(rng, words, sizes, args.position) for _ in range(args.batch)))
        loss = torch.nn.functional.cross_entropy(probe(list(pages)), torch.tensor(labels))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: train loss {loss.item():.3f} (chance {math.log(len(words)):.3f})")
    with torch.no_grad():
        pages, labels = zip(*(draw_word(held_out, words, sizes, args.position) for _ in range(256)))
        accuracy = (probe(list(pages)).argmax(-1) == torch.tensor(labels)).float().mean().item()
    print(f"machine: {machine()}")
    print(f"{len(words)} words, position {args.position}, pool {args.pool}, {args.size}-px, "
          f"crops {args.num_crops}x{args.crop}px, "
          f"vision width {args.vision_width}, {args.steps} steps x {args.batch}, lr {args.lr}: "
          f"held-out accuracy {accuracy:.1%} (chance {1 / len(words):.1%}), {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
