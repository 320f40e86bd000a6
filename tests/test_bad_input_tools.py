"""Bad input on the newer tools, one section per failure family: numbers out of range (refused at the boundary with
the allowed range), non-finite vectors and scores, damaged files (named), shipped models the manifest cannot vouch
for, evaluation settings that differ from training, and resumes that cannot be trusted."""

import math

import pytest

from hkrag.index.multivector import MultiVectorSpec
from hkrag.index.spec import IndexSpec
from hkrag.ranges import POSITIVE, parse_size

# --- 1. numbers on the command line and in specs ------------------------------------------------------------------


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("option, value, allowed", [
    ("--processes", "0", "expected an integer >= 1 and <= 65536"),
    ("--processes", "-2", "expected an integer >= 1"),
    ("--processes", "1e9", "expected an integer >= 1"),
    ("--layers", "0", "expected an integer >= 1"),
    ("--measure-one", "0", "expected an integer >= 1"),
    ("--pages", "nan", "expected an integer >= 1"),
    ("--gpu-memory", "0", "not a memory size: expected a number > 0"),
    ("--gpu-memory", "-80", "not a memory size"),
    ("--gpu-memory", "nan", "not a memory size"),
    ("--gpu-memory", "inf", "not a memory size"),
    ("--gpu-memory", "8e9GB", "up to 1126 TB"),
])
def test_preflight_numbers_are_refused_with_their_range(option, value, allowed, capsys):
    from hkrag.tasks.preflight import main

    error = _usage_error(main, ["experiment=hkrag_retriever", option, value], capsys)
    assert f"argument {option}" in error and allowed in error and repr(value) in error


@pytest.mark.parametrize("argv, named", [
    (["--k", "0"], "argument --k: '0': expected an integer >= 1"),
    (["--k", "nan"], "argument --k: 'nan'"),
    (["--target", "0"], "argument --target: '0': expected a number > 0 and <= 1"),
    (["--target", "1.5"], "expected a number > 0 and <= 1"),
    (["--confidence", "1"], "argument --confidence: '1': expected a number >= 0.5 and < 1"),
    (["--max-ram", "-1"], "argument --max-ram: '-1': expected a number > 0"),
    (["--chunk", "0"], "argument --chunk"),
])
def test_the_tuner_refuses_numbers_out_of_range(argv, named, capsys):
    from hkrag.index.tuning import main

    error = _usage_error(main, ["--index", "i", "--shards", "s", "--queries", "q", *argv], capsys)
    assert named in error


@pytest.mark.parametrize("value", ["0", "-1", "inf", "x"])
def test_the_agent_step_report_refuses_a_query_cap_that_is_not_positive(value, tmp_path, capsys):
    from hkrag.tasks.agent_steps import main

    error = _usage_error(main, [str(tmp_path), "--out", str(tmp_path / "o"), "--max-queries", value], capsys)
    assert f"argument --max-queries: {value!r}: expected an integer >= 1" in error


@pytest.mark.parametrize("value", ["0", "-3"])
def test_the_budget_sweep_refuses_k_below_one(value, capsys):
    from hkrag.retrieval.budget import main

    error = _usage_error(main, ["--shards", "s", "--queries", "q", "--qrels", "r", "--k", value], capsys)
    assert "argument --k" in error and "expected an integer >= 1" in error


@pytest.mark.parametrize("spec, named", [
    ("ivfpq:nbits=0", "index setting nbits=0: expected an integer >= 1 and <= 16"),
    ("ivfpq:nbits=40", "nbits=40"),
    ("ivfpq:m=abc", "index setting m='abc': expected an integer"),
    ("ivfpq:nprobe=0", "index setting nprobe=0"),
    ("ivfpq:nlist=-4", "index setting nlist=-4"),
    ("faiss:HNSW0,Flat", "HNSW0 in 'HNSW0,Flat': M (graph links a node)=0: expected an integer >= 2 and <= 512"),
    ("faiss:HNSW100000,SQ8", "M (graph links a node)=100000"),
    ("faiss:IVF0,Flat", "nlist (inverted lists)=0"),
    ("faiss:IVF16,PQ8x0", "PQ8x0 in 'IVF16,PQ8x0': nbits (bits per code)=0: expected an integer >= 1 and <= 16"),
    ("faiss:IVF16,PQ8x40", "nbits (bits per code)=40"),
    ("faiss:HNSW32,Flat;efSearch=0", "search parameter efSearch=0: expected an integer >= 1 and <= 1.04858e+06"),
    ("faiss:HNSW32,Flat;efSearch=nan", "search parameter efSearch='nan'"),
    ("faiss:HNSW32,Flat;efSearch=-1", "efSearch=-1"),
    ("faiss:IVF16,Flat;nprobe=1e12", "nprobe='1e12'"),
    ("faiss:IVF16,Flat,Refine(Flat);k_factor_rf=0", "k_factor_rf=0.0: expected a number >= 1"),
])
def test_index_specs_out_of_range_are_refused_naming_the_setting(spec, named):
    with pytest.raises(ValueError) as error:
        IndexSpec.parse(spec)
    assert named in str(error.value)


@pytest.mark.parametrize("spec, named", [
    ("rerank=-1", "multi-vector index setting rerank=-1: expected an integer >= 0"),
    ("rerank=nan", "rerank='nan'"),
    ("stage=tokens;prune=-5", "multi-vector index setting prune=-5"),
    ("candidates=0", "candidates=0: expected an integer >= 1"),
    ("pool=0", "pool=0"),
    ("stage=plaid;t_cs=nan", "t_cs=nan: expected a number >= -1 and <= 1"),
    ("stage=plaid;ndocs=inf", "ndocs='inf'"),
    ("stage=muvera;ksim=99", "ksim=99"),
    ("codec=PQ16x0", "PQ16x0 in 'PQ16x0': nbits (bits per code)=0"),
    ("codec=PQ16x64", "nbits (bits per code)=64"),
    ("stage=muvera;stage_index=HNSW0,Flat", "M (graph links a node)=0"),
    ("stage=muvera;stage_index=HNSW16,Flat;stage_params=efSearch=0", "search parameter efSearch=0"),
])
def test_multivector_specs_out_of_range_are_refused_naming_the_setting(spec, named):
    with pytest.raises(ValueError) as error:
        MultiVectorSpec.parse(spec)
    assert named in str(error.value)


def test_the_documented_zero_settings_still_mean_none_and_valid_specs_parse():
    assert MultiVectorSpec.parse("rerank=0;prune=0").rerank == 0
    assert IndexSpec.parse("faiss:HNSW32,SQ8;efSearch=64,k_factor_rf=4").params == "efSearch=64,k_factor_rf=4"
    assert parse_size("79.6GiB") == int(79.6 * 2**30) and parse_size("80") == 80 * 10**9
    assert POSITIVE.arg("3") == 3 and math.isclose(POSITIVE.describe() == "an integer >= 1", True)
