"""bench/memory_timeline.py: the live tensors at a profiled step's peak, where each was allocated and what freed it."""

import importlib.util
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hkrag.training.memory import STEP_RANGE

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "memory_timeline.py"


def load_timeline():
    spec = importlib.util.spec_from_file_location("memory_timeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def profiled_step() -> list:
    """A step outside which one tensor lives and inside which a linear layer and a GELU run forward and backward."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 512)
    x = torch.randn(256, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        before = torch.randn(128, 128)  # alive when the step begins: the baseline
        with torch.profiler.record_function(STEP_RANGE):
            torch.nn.functional.gelu(linear(x)).sum().backward()
        del before
    return prof.profiler.kineto_results.experimental_event_tree()


def test_the_peak_lists_the_saved_activation_with_its_module_and_the_backward_that_freed_it():
    timeline = load_timeline()
    tree = profiled_step()
    baseline, peak, alive = timeline.live_at_peak(timeline.allocations(tree), *timeline.step_window(tree))
    assert baseline >= 128 * 128 * 4
    sites = {row.site: (row.size, freed) for row, freed in alive.values()}
    linear_out = [(size, freed) for site, (size, freed) in sites.items() if site.startswith("Linear | aten::addmm")]
    assert linear_out == [(256 * 512 * 4, "- | - | backward of GeluBackward0")]  # the GELU's saved input
    assert peak >= 2 * 256 * 512 * 4  # the saved input and the GELU's gradient or output beside it
    rows = timeline.grouped(alive, 1)
    assert rows[0][2] == max(total for _, _, total, _ in rows)


def test_after_a_site_the_peak_is_the_later_phases():
    timeline = load_timeline()
    tree = profiled_step()
    rows = timeline.allocations(tree)
    window = timeline.step_window(tree)
    _, whole, _ = timeline.live_at_peak(rows, *window)
    _, late, alive = timeline.live_at_peak(rows, *window, after="backward of AddmmBackward0")
    assert 0 < late <= whole
    assert not any(row.site.startswith("Linear | aten::addmm") for row, _ in alive.values())  # freed by the GELU's
