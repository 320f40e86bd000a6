"""The preflight under the late-interaction head: the projection's parameters, every token's vector in the gradient
cache and the MaxSim loss's token scores, by hand for experiment=reader_li_tiny."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkrag.tasks.preflight import compose_config, overrides_first, plan, predicted_row, report
from hkrag.training.memory import MAXSIM_BYTES_PER_SCORE

# reader_li_tiny on the tiny Phi3V (fp32): hidden 64, projection to 128, 60 tokens per page, 36 per query plus the
# 10 augmentation tokens = 46; global batch 32 in one chunk of 32, no hard negatives.
PROJECTION = 64 * 128 + 128  # 8,320 parameters
PROJECTION_BYTES = PROJECTION * (4 + 4 + 3 * 4)  # frozen original + trained copy (fp32 here), gradient, two moments
CACHE = 2 * 32 * (46 + 60) * 128 * 4  # token vectors and their gradients: 3,473,408
SCORES = 32 * 32 * 46 * 60 * 13  # 32 x 32 pairs of 46 x 60 token scores, 13 bytes each: 36,741,120
PROJECTED = 32 * 60 * (64 * 4 + 128 * (4 + 4 + 4))  # the chunk's 1,920 tokens: projection input, output, copies


@pytest.fixture(scope="module")
def plans():
    late = plan(compose_config(["experiment=reader_li_tiny"]))
    dense = plan(compose_config(["experiment=reader_li_tiny", "model.head=dense"]))
    return late, dense


def test_the_late_interaction_terms_by_hand(plans):
    late, dense = plans
    assert MAXSIM_BYTES_PER_SCORE == 13
    assert late.work.query_tokens == dense.work.query_tokens + 10 == 46 and late.work.page_tokens == 60
    terms = late.estimate.terms
    assert terms["late-interaction projection (frozen + trained copy, gradient, AdamW)"] == PROJECTION_BYTES == 166_400
    assert terms["gradient cache: token vectors + gradients (fp32)"] == CACHE == 3_473_408
    assert "gradient cache: embeddings + gradients (fp32)" not in terms  # one 64-d vector per row: dense only
    assert dense.estimate.terms["gradient cache: embeddings + gradients (fp32)"] == 2 * 2 * 32 * 64 * 4
    phases = late.estimate.phases
    assert phases["MaxSim loss over the global batch (token scores)"] == SCORES == 36_741_120
    lm = "language model backward (one chunk)"
    assert phases[lm] - dense.estimate.phases[lm] == PROJECTED == 3_440_640
    assert late.estimate.peak == late.estimate.persistent + max(phases.values())


def test_the_report_names_the_head_and_its_terms(plans):
    text = report(plans[0], None)
    assert ("late-interaction head: projection 64 -> 128 (8,320 parameters, trained), 46 tokens per query with the "
            "augmentation tokens, 60 vectors per page; MaxSim scores 32 queries x 32 pages") in text
    assert "MaxSim loss over the global batch (token scores)" in text
    assert "late-interaction head" not in report(plans[1], None)


def test_hard_negatives_widen_the_score_matrix_and_masked_terms_alone_score_none():
    negatives = plan(compose_config(["experiment=reader_li_tiny", "trainer.hard_negatives=2"]))
    assert negatives.estimate.phases["MaxSim loss over the global batch (token scores)"] == 3 * SCORES
    masked = plan(compose_config(["experiment=reader_li_tiny", "loss=hkrag"]))
    assert "MaxSim loss over the global batch (token scores)" not in masked.estimate.phases
    assert "(masked terms only: chunked, not counted)" in report(masked, None)


REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "phi3v"


@pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"needs Phi-3-vision's config and tokenizer in {REFERENCE}")
def test_a_measured_row_counts_the_projections_two_copies_with_the_frozen_model():
    """``--measure`` builds the projection with the model (peft's frozen original and trained copy): the measured
    parameters of the 1-layer rows differ by 2 x (3072 x 128 + 128) = 786,688 between the heads
    (bench/runs/2026-11-26-cpu), and so must the predicted ones; the copies' fp32 bytes move to the frozen side."""
    overrides = ["experiment=hkrag_retriever", "loss=infonce", "model.num_crops=4", "model.attn_implementation=sdpa",
                 "trainer.global_batch_size=4", "trainer.chunk_size=2"]
    row = {"layers": 1, "vision_layers": 2, "device": "cpu", "dtype": "float32"}
    late = predicted_row(compose_config([*overrides, "model.head=late_interaction"]), row, str(REFERENCE))
    dense = predicted_row(compose_config([*overrides, "model.head=dense"]), row, str(REFERENCE))
    assert late["predicted_parameters"] - dense["predicted_parameters"] == 786_688
    assert late["predicted_weights"] - dense["predicted_weights"] == 786_688 * 4


def test_overrides_may_follow_the_depth_options():
    argv = ["--measure", "--layers", "1", "2", "--vision-layers", "2", "model.num_crops=4", "--out", "rows.json",
            "trainer.chunk_size=2"]
    assert overrides_first(argv) == ["model.num_crops=4", "trainer.chunk_size=2", "--measure", "--layers", "1", "2",
                                     "--vision-layers", "2", "--out", "rows.json"]
