"""The generator's cost per query: HKRAG's agents against the single-pass baseline, with and without reuse.

    python bench/agents.py                         # tiny Phi3V on the CPU
    python bench/agents.py --device cuda --queries 20

Every generator answers the same ``--queries`` questions over 3 synthetic pages each (the paper's top-3)
on one local backend. HKRAG runs twice: with the Judger's threshold h = 0.8 (the paper's) and with h = 0
(every query routed to the Decoupler, the most expensive path: Pruner, Judger, ``max_iters`` Decoupler
rounds, Summarizer). Each runs with the backend's page-feature cache on (``feature_cache_size=32``, the
default: the agents ask several questions about the same pages) and off (0). Printed per configuration:
LVLM calls, input/output tokens and wall time per query (medians over queries of the median of
``--repeats`` runs), and the wall-time ratio to single-pass. A tiny random model never emits its end token,
so every reply runs to its token cap; the ratios, not the seconds, carry over to a real model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not bench/: this file's name would shadow the agents package
from agents import build_generator  # noqa: E402
from agents.records import Query  # noqa: E402
from bench.common import machine  # noqa: E402
from hkrag.lvlm import PageImage, build_backend  # noqa: E402

CONFIGURATIONS = {  # name -> (generator config, overrides)
    "single-pass": ("single_pass", {}),
    "HKRAG h=0.8": ("hkrag", {}),
    "HKRAG h=0 (all HQP)": ("hkrag", {"threshold": 0.0}),
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


def measure(generator_cfg: dict, backend, queries: list[Query], repeats: int) -> dict[str, float]:
    """Median calls, tokens and wall seconds per query."""
    walls: list[list[float]] = [[] for _ in queries]
    outcomes = []
    for _ in range(repeats):
        backend.features.clear()  # every repeat starts cold
        generator = build_generator(generator_cfg, backend)
        outcomes = []
        for i, query in enumerate(queries):
            start = time.perf_counter()
            outcomes.append(generator.answer(query))
            walls[i].append(time.perf_counter() - start)
    failed = [o.failure for o in outcomes if o.failed]
    if failed:
        raise RuntimeError(f"{len(failed)} queries failed, e.g. {failed[0]}")
    return {
        "calls": statistics.median(o.num_calls for o in outcomes),
        "input_tokens": statistics.median(o.prompt_tokens for o in outcomes),
        "output_tokens": statistics.median(o.completion_tokens for o in outcomes),
        "wall_s": statistics.median(statistics.median(w) for w in walls),
        "routes": ",".join(sorted({o.route for o in outcomes})),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    conf = ROOT / "conf"
    queries = [Query(query_id=str(i), question=f"What is the value in row {i}?", pages=query_pages(i), gold=["1"])
               for i in range(args.queries)]
    print(machine())
    print(f"{args.queries} queries x 3 pages, tiny Phi3V ({args.device}), medians of {args.repeats} runs")
    header = f"{'configuration':<22} {'reuse':<5} {'routes':<11} {'calls':>5} {'in tok':>7} {'out tok':>7} " \
             f"{'wall s':>7} {'vs single':>9}"
    print(header)
    baseline = {}
    for reuse in (True, False):
        backend = build_backend("phi3v", base="tiny", device=args.device, dtype="float32",
                                feature_cache_size=32 if reuse else 0)
        for name, (group, overrides) in CONFIGURATIONS.items():
            generator_cfg = {**generator_config(conf, group), **overrides}
            row = measure(generator_cfg, backend, queries, args.repeats)
            baseline.setdefault(reuse, row["wall_s"])
            print(f"{name:<22} {'on' if reuse else 'off':<5} {row['routes']:<11} {row['calls']:>5.0f} "
                  f"{row['input_tokens']:>7.0f} {row['output_tokens']:>7.0f} {row['wall_s']:>7.3f} "
                  f"{row['wall_s'] / baseline[reuse]:>8.2f}x")
        backend.close()


if __name__ == "__main__":
    main()
