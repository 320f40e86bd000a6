"""The generator's cost per query: HKRAG's agents against the single-pass baseline, with and without reuse.

    python bench/generator_cost.py                         # tiny Phi3V on the CPU
    python bench/generator_cost.py --answer-tokens 8       # answers capped as a real model's short answers end
    python bench/generator_cost.py --reuse all features none
    python bench/generator_cost.py --configs single hkrag  # skip the slow all-HQP row
    python bench/generator_cost.py --device cuda --full --answer-tokens 8 --queries 20  # Phi-3-vision size, random bf16

Every generator answers the same ``--queries`` questions over 3 synthetic pages each (the paper's top-3)
on a local backend. HKRAG runs twice: with the Judger's threshold h = 0.8 (the paper's) and with h = 0
(every query routed to the Decoupler, the most expensive path: Pruner, Judger, ``max_iters`` Decoupler
rounds, Summarizer). Each runs under every ``--reuse`` setting of the backend's caches (the agents ask
several questions about the same pages, images first):

* ``all`` (default): page features (``feature_cache_size=32``) and prompt-prefix keys and values
  (``prefix_cache_size=8``) reused, the backend's defaults;
* ``features``: page features only, every call prefills its whole prompt;
* ``none`` (default): nothing reused.

Every query starts with empty caches (its pages are new), and every round runs each configuration on
each query in turn, so a shared machine's changing load hits all rows alike. Printed per configuration:
LVLM calls, input tokens, input tokens taken from a cached prefix instead of prefilled (``reused``),
output tokens and wall seconds per query (medians over queries and rounds), and the median over queries
and rounds of the wall-time ratio to single-pass on the same query in the same round, same reuse.

A tiny random model never emits its end token, so every reply runs to its token cap (``max_new_tokens``
of the generator config: 64 for answers); ``--answer-tokens`` lowers the answers' cap, as a real model's
short answers end after a few tokens. The tiny model's prefill is cheap next to its per-token decoding
overhead, so its seconds weigh decode steps and calls; the token columns carry over to a real model,
whose prefill over thousands of image tokens per page is what the prefix cache saves. ``--full`` runs a
Phi-3-vision-sized model with random bf16 weights (``bench/lvlm.py``'s, 16 crops) for those seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from common import machine
from hydra import compose, initialize_config_dir
from lvlm import full_backend
from omegaconf import OmegaConf
from PIL import Image
from tqdm import tqdm

from agents import build_generator
from hkrag.lvlm import PageImage
from hkrag.lvlm.phi3v import Phi3VBackend
from hkrag.rag.records import Query

ROOT = Path(__file__).resolve().parents[1]

CONFIGURATIONS = {  # --configs id -> (printed name, generator config, overrides)
    "single": ("single-pass", "single_pass", {}),
    "hkrag": ("HKRAG h=0.8", "hkrag", {}),
    "hkrag-h0": ("HKRAG h=0 (all HQP)", "hkrag", {"threshold": 0.0}),
}


def query_pages(number: int, size: int = 200) -> list[PageImage]:
    """Three distinct pages for query ``number``."""
    out = []
    for i in range(3):
        image = Image.new("RGB", (size, int(size * 1.3)), (255, 255, 255))
        image.paste(((40 * number + 70 * i) % 255, 120, 200 - 50 * i), (size // 5, size // 5, size // 2, size // 3))
        out.append(PageImage(image, f"q{number}-p{i}"))
    return out


def generator_config(conf: Path, group: str) -> dict:
    """``conf/generator/<group>.yaml`` as eval.py composes it."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return OmegaConf.to_container(compose("eval", [f"generator={group}"]).generator, resolve=True)


REUSE = {  # --reuse -> (feature_cache_size, prefix_cache_size)
    "all": (32, 8),
    "features": (32, 0),
    "none": (0, 0),
}


def cold_answer(generator, backend, query: Query) -> tuple[Any, float, int]:
    """One query from empty caches: its outcome, wall seconds and prompt tokens taken from a cached prefix."""
    backend.close()
    before = backend.prefixes.reused_tokens
    start = time.perf_counter()
    outcome = generator.answer(query)
    wall = time.perf_counter() - start
    if outcome.failed:
        raise RuntimeError(f"query {query.query_id} failed: {outcome.failure}")
    return outcome, wall, backend.prefixes.reused_tokens - before


def summary(runs: list[tuple[Any, float, int]], baseline: list[tuple[Any, float, int]]) -> dict[str, Any]:
    """Medians per query; ``ratio`` is the median of each run's wall time over the baseline's on the same
    query in the same round (paired, so load that shifts during the run cancels)."""
    outcomes = [outcome for outcome, _, _ in runs]
    return {
        "calls": statistics.median(o.num_calls for o in outcomes),
        "input_tokens": statistics.median(o.prompt_tokens for o in outcomes),
        "reused_tokens": statistics.median(reused for _, _, reused in runs),
        "output_tokens": statistics.median(o.completion_tokens for o in outcomes),
        "wall_s": statistics.median(wall for _, wall, _ in runs),
        "ratio": statistics.median(wall / base for (_, wall, _), (_, base, _) in zip(runs, baseline)),
        "routes": ",".join(sorted({o.route for o in outcomes})),
    }


def make_backend(reuse: str, device: str, full: bool):
    """The tiny Phi3V (fp32), or a full-size random bf16 one, with the caches ``reuse`` names."""
    features, prefixes = REUSE[reuse]
    if not full:
        return Phi3VBackend(base="tiny", device=device, dtype="float32", feature_cache_size=features,
                            prefix_cache_size=prefixes)
    backend = full_backend(Phi3VBackend.name, device)
    backend.features.capacity, backend.prefixes.capacity = features, prefixes
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="Phi-3-vision-sized model, random bf16 (use a GPU)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGURATIONS), default=list(CONFIGURATIONS),
                        help="generators to run; the first is the ratios' baseline")
    parser.add_argument("--reuse", nargs="+", choices=list(REUSE), default=["all", "none"])
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="cap on answer lengths (default: the generator config's max_new_tokens.answer)")
    args = parser.parse_args()

    conf = ROOT / "conf"
    queries = [Query(query_id=str(i), question=f"What is the value in row {i}?", pages=query_pages(i), gold=["1"])
               for i in range(args.queries)]
    backends = {reuse: make_backend(reuse, args.device, args.full) for reuse in args.reuse}
    rows = [(config, reuse) for reuse in args.reuse for config in args.configs]
    generators = {}
    for config, reuse in rows:
        _, group, overrides = CONFIGURATIONS[config]
        generator_cfg = {**generator_config(conf, group), **overrides}
        if args.answer_tokens is not None:
            generator_cfg["caps"]["max_new_tokens"]["answer"] = args.answer_tokens
        generators[config, reuse] = build_generator(generator_cfg, backends[reuse])
    runs: dict[tuple[str, str], list] = {row: [] for row in rows}
    for _ in tqdm(range(args.repeats), desc="rounds"):  # every row answers each query in turn: paired timings
        for query in queries:
            for config, reuse in rows:
                runs[config, reuse].append(cold_answer(generators[config, reuse], backends[reuse], query))

    print(machine())
    cap = "" if args.answer_tokens is None else f", answers capped at {args.answer_tokens} tokens"
    size = "full-size Phi3V, random bf16" if args.full else "tiny Phi3V"
    print(f"{args.queries} queries x 3 pages, {size} ({args.device}), {args.repeats} rounds{cap}")
    print(f"{'configuration':<22} {'reuse':<8} {'routes':<11} {'calls':>5} {'in tok':>7} {'reused':>7} "
          f"{'out tok':>7} {'wall s':>7} {'vs ' + CONFIGURATIONS[args.configs[0]][0]:>15}")
    for config, reuse in rows:
        row = summary(runs[config, reuse], runs[args.configs[0], reuse])
        print(f"{CONFIGURATIONS[config][0]:<22} {reuse:<8} {row['routes']:<11} {row['calls']:>5.0f} "
              f"{row['input_tokens']:>7.0f} {row['reused_tokens']:>7.0f} {row['output_tokens']:>7.0f} "
              f"{row['wall_s']:>7.3f} {row['ratio']:>14.2f}x")


if __name__ == "__main__":
    main()
