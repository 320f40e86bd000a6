"""Bad input on the newer tools, one section per failure family: numbers out of range (refused at the boundary with
the allowed range), non-finite vectors and scores, damaged files (named), shipped models the manifest cannot vouch
for, evaluation settings that differ from training, and resumes that cannot be trusted."""

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_training_overrides

from hkrag.index.multivector import MultiVectorSpec
from hkrag.index.spec import IndexSpec
from hkrag.ranges import POSITIVE, parse_size

sys.path.insert(0, str(Path(__file__).parent))

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


@pytest.mark.parametrize("processes", [33, 64])
def test_preflight_refuses_more_processes_than_the_global_batch(processes):
    from hkrag.tasks.preflight import main

    with pytest.raises(SystemExit, match=rf"--processes {processes} is more than trainer.global_batch_size=32"):
        main(["experiment=demo", "--processes", str(processes)])


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

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}\n")  # a run folder: only the cap is wrong
    error = _usage_error(main, [str(tmp_path), "--out", str(tmp_path / "o"), "--max-queries", value], capsys)
    assert f"argument --max-queries: {value!r}: expected an integer >= 1" in error


@pytest.mark.parametrize("value", ["0", "-3"])
def test_the_budget_sweep_refuses_k_below_one(value, capsys):
    from hkrag.retrieval.budget import main

    error = _usage_error(main, ["--shards", "s", "--queries", "q", "--qrels", "r", "--k", value], capsys)
    assert "argument --k" in error and "expected an integer >= 1" in error


@pytest.mark.parametrize("argv, named", [(["--depth", "0"], "argument --depth: '0': expected an integer >= 1"),
                                         (["--keep", "-1"], "argument --keep"), (["--skip", "-1"], "argument --skip")])
def test_hard_negative_mining_refuses_counts_out_of_range(argv, named, capsys):
    from hkrag.index.mine import main

    error = _usage_error(main, ["--queries", "q", "--corpus", "c", "--qrels", "r", "--out", "o", *argv], capsys)
    assert named in error


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
    assert POSITIVE.arg("3") == 3 and POSITIVE.describe() == "an integer >= 1"


# --- 3. damaged files name the file --------------------------------------------------------------------------------


@pytest.mark.parametrize("content, named", [
    ('{"identity": {"a": 1', "line 1 column 21: not valid JSON (truncated?)"),
    ("", "not valid JSON (truncated?)"),
    ('{"identity": 1}\ngarbage', "line 2 column 1: not valid JSON"),
    (b'{"identity": "\xff"}', "line 1 is not UTF-8 (invalid start byte at byte 14)"),
    ('{"other": 1}', "run config lacks key(s) ['identity'] (found ['other'])"),
    ("[1, 2]", "lacks key(s) ['identity'] (found list)"),
])
def test_a_damaged_json_file_is_named_with_what_is_wrong(tmp_path, content, named):
    from hkrag.io import FileFormatError, read_json

    path = tmp_path / "rag_config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(FileFormatError) as error:
        read_json(path, keys=("identity",), what="run config")
    assert str(error.value).startswith(f"{path}: ") and named in str(error.value)


@pytest.mark.parametrize("content, named", [
    ('{"doc_id": "a", "selected": []}\n{"doc_id": "b", "sel', "line 2: not valid JSON (truncated?)"),
    ('{"doc_id": "a"}\n', "line 1: record lacks key(s) ['selected']"),
    ('\n{"doc_id": "a", "selected": []}\n[]\n', "line 3: record lacks key(s) ['doc_id', 'selected']"),
    (b'{"doc_id": "a", "selected": []}\n{"doc_id": "\xe9"}\n', "line 2 is not UTF-8"),
])
def test_region_rows_without_their_keys_or_truncated_name_the_file_and_line(tmp_path, content, named):
    from hkrag.data.region_corpus import detected_regions
    from hkrag.io import FileFormatError

    path = tmp_path / "chartqa" / "test.jsonl"
    path.parent.mkdir()
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(FileFormatError) as error:
        detected_regions(tmp_path, "chartqa", "test")
    assert str(error.value).startswith(f"{path}: ") and named in str(error.value)


@pytest.mark.parametrize("row", ['{"doc_id": "p0", "split": "test"}', '{"split": "test", "items": []}'])
def test_a_corpus_without_items_is_named_by_the_fine_print_reader(tmp_path, row):
    from hkrag.data.degrade import fine_print_boxes
    from hkrag.io import FileFormatError

    path = tmp_path / "pages.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(FileFormatError, match=r"pages.jsonl: line 1: record lacks key\(s\)"):
        fine_print_boxes(path)


def _saved_index(tmp_path):
    from hkrag.index.faiss_index import DocumentIndex

    vectors = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    index = DocumentIndex.build([f"d{i}" for i in range(40)], vectors, "flat", use_gpu=False)
    return index.save(tmp_path / "index"), vectors


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("keep", [0, 3, 0.5, -1])
def test_a_truncated_faiss_index_is_named_before_faiss_reads_it(tmp_path, mmap, keep):
    from hkrag.index.faiss_index import DocumentIndex
    from hkrag.io import FileFormatError

    directory, _ = _saved_index(tmp_path)
    path = directory / "index.faiss"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep % len(data)])
    with pytest.raises(FileFormatError, match=rf"index.faiss: holds \d+ bytes, {len(data)} were written"):
        DocumentIndex.load(directory, use_gpu=False, mmap=mmap)


def test_an_index_saved_before_sizes_were_recorded_still_names_a_truncated_file(tmp_path):
    from hkrag.index.faiss_index import DocumentIndex
    from hkrag.io import FileFormatError, read_json, write_json

    directory, vectors = _saved_index(tmp_path)
    meta = read_json(directory / "index.json")
    write_json(directory / "index.json", {k: v for k, v in meta.items() if k != "index_bytes"})
    assert len(DocumentIndex.load(directory, use_gpu=False)) == 40  # an old, whole index loads
    path = directory / "index.faiss"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FileFormatError, match="index.faiss: not a readable FAISS index .truncated or corrupt."):
        DocumentIndex.load(directory, use_gpu=False)


@pytest.mark.parametrize("name, keep", [("codec.faiss", 0.5), ("codec.faiss", 0), ("stage.faiss", 0.9),
                                        ("multivector.json", 0.5), ("codes.npy", 0.5), ("offsets.npy", 0.3),
                                        ("codes.npy", 0)])
def test_a_damaged_multivector_index_file_is_named(tmp_path, name, keep):
    from hkrag.index.multivector import MultiVectorIndex
    from hkrag.io import FileFormatError

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((60, 8)).astype(np.float32)
    index = MultiVectorIndex.build([f"p{i}" for i in range(20)], vectors, np.arange(0, 61, 3),
                                   "stage=muvera;stage_index=HNSW8,Flat;candidates=5")
    directory = index.save(tmp_path / "mv")
    path = directory / name
    path.write_bytes(path.read_bytes()[: int(len(path.read_bytes()) * keep)])
    with pytest.raises(FileFormatError, match=rf"^{path}: "):
        MultiVectorIndex.load(directory)


@pytest.mark.parametrize("damage", ['{"spec": {"kind": "fl', "", '{"dim": 8}'])
def test_a_tuned_index_with_damaged_settings_is_named(tmp_path, damage):
    from hkrag.io import FileFormatError

    directory, _ = _saved_index(tmp_path)
    (directory / "index.json").write_text(damage)
    with pytest.raises(FileFormatError, match="index.json: "):
        IndexSpec.parse(f"tuned:{directory}")


@pytest.mark.parametrize("damage", ['[{"layers": 1, "peak"', '[{"layers": 1}]\n]'])
def test_recorded_measurement_rows_that_are_damaged_are_named(tmp_path, damage):
    from hkrag.io import FileFormatError
    from hkrag.tasks.preflight import main

    rows = tmp_path / "rows.json"
    rows.write_text(damage)
    with pytest.raises(FileFormatError, match=rf"^{rows}: line \d+ column \d+: not valid JSON"):
        main(["experiment=hkrag_retriever", "--compare", str(rows)])


def test_a_truncated_rag_config_is_named_and_left_as_it_was(tmp_path):
    from omegaconf import OmegaConf

    from hkrag.io import FileFormatError
    from hkrag.tasks.rag import prepare_run_dir

    (tmp_path / "trace" / "parts").mkdir(parents=True)
    (tmp_path / "trace" / "parts" / "part-0.jsonl").write_text("{}\n")
    marker = tmp_path / "rag_config.json"
    marker.write_text('{"hash": "ab", "identity": {"task": "ra')
    cfg = OmegaConf.create({"task": {"name": "rag"}, "rag": {"resume": True}})
    with pytest.raises(FileFormatError, match=rf"^{tmp_path}/rag_config.json: line 1 column \d+: not valid JSON"):
        prepare_run_dir(cfg, tmp_path)
    assert marker.read_text() == '{"hash": "ab", "identity": {"task": "ra'


def _evaluation(folder, scores: dict[str, float], dataset="synfine", pool="all"):
    from hkrag.io import write_json

    folder.mkdir()
    write_json(folder / "per_query.json", {dataset: {pool: {q: {"ndcg@5": s} for q, s in scores.items()}}})
    return folder


@pytest.mark.parametrize("second, named", [
    ({"q1": 0.5}, r"lacks 1 \(e.g. \['q2'\]\) and adds 0"),
    ({"q1": 0.5, "q2": 0.1, "q3": 1.0}, r"lacks 0 \(e.g. \[\]\) and adds 1 \(e.g. \['q3'\]\)"),
    ({"q1": 0.5, "q9": 0.1}, r"lacks 1 \(e.g. \['q2'\]\) and adds 1 \(e.g. \['q9'\]\)"),
])
def test_a_seed_table_refuses_runs_that_do_not_share_their_questions(tmp_path, second, named, capsys):
    from hkrag.tasks.seeds import main

    a, b = _evaluation(tmp_path / "s0", {"q1": 1.0, "q2": 0.0}), _evaluation(tmp_path / "s1", second)
    error = _usage_error(main, [str(a), str(b), "--corpus", str(tmp_path / "corpus")], capsys)
    assert "do not share the questions of synfine/all" in error
    assert re.search(named, error)


# --- 2. non-finite vectors and scores ------------------------------------------------------------------------------


def _spoiling(row: int, value: float, multi_vector: bool = False):
    """An embedding function whose document ``row`` (of the corpus) holds ``value`` in its first entry."""
    from test_shards import embed, tokens

    def fn(rows):
        out = tokens(rows) if multi_vector else embed(rows).numpy()
        for i, r in enumerate(rows):
            if r["seed"] == row:
                out[i] = np.array(out[i], copy=True)
                out[i].flat[-1] = value
        return out
    return fn


BAD_VALUES = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("multi_vector", [False, True])
@pytest.mark.parametrize("value, dtype", [*((v, "float32") for v in BAD_VALUES), (1e6, "float16")])
def test_a_shard_with_a_non_finite_row_is_not_written(tmp_path, value, dtype, multi_vector):
    from test_shards import encode

    from hkrag.index.shards import ShardError

    with pytest.raises(ShardError, match=r"shard-00001: row 2 \(page id 'doc007'.*\) holds NaN or infinite values "
                                         r"\(1 of 5 rows do\); not written"):
        encode(_corpus(), tmp_path, embed_fn=_spoiling(7, value, multi_vector), dtype=dtype, multi_vector=multi_vector)
    assert not (tmp_path / "shard-00001.npy").exists() and (tmp_path / "shard-00000.npy").exists()


def _corpus(n=12):
    return [{"doc_id": f"doc{i:03d}", "seed": i} for i in range(n)]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_dense_shard_damaged_on_disk_is_refused_when_read(tmp_path, value, dtype):
    from test_shards import encode

    from hkrag.index.shards import ShardError, load_shards

    encode(_corpus(), tmp_path, dtype=dtype)
    path = tmp_path / "shard-00002.npy"
    block = np.load(path)
    block[1, 3] = value
    np.save(path, block)
    with pytest.raises(ShardError, match=r"shard-00002: row 1 \(page id 'doc011'\) holds NaN or infinite values"):
        load_shards(tmp_path)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_multivector_shard_damaged_on_disk_is_refused_when_read(tmp_path, value):
    from test_shards import encode_tokens

    from hkrag.index.shards import ShardError, load_multi_vector_shards

    encode_tokens(_corpus(), tmp_path, dtype="float16")
    path = tmp_path / "shard-00001.npy"
    block, offsets = np.load(path), np.load(tmp_path / "shard-00001.offsets.npy")
    block[offsets[2] + 1, 0] = value  # page 2 of the shard (doc007, 4 tokens), its second token
    np.save(path, block)
    with pytest.raises(ShardError, match=r"shard-00001: row 2 \(page id 'doc007', token 1\) holds NaN or infinite"):
        load_multi_vector_shards(tmp_path)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_ranking_with_a_non_finite_score_is_not_cut(value):
    from hkrag.retrieval.metrics import cut_with_ties, truncate

    run = {"q1": {"a": 0.5, "b": 0.2}, "q2": {"a": 0.9, "b": value, "c": 0.1}}
    for cut in (cut_with_ties, truncate):
        with pytest.raises(ValueError, match=rf"query 'q2': page 'b' scored {value}, which cannot be ranked"):
            cut(run, 1)


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_non_finite_query_vector_is_refused_by_the_index(tmp_path, value):
    directory, vectors = _saved_index(tmp_path)
    from hkrag.index.faiss_index import DocumentIndex

    queries = vectors[:3].copy()
    queries[2, 0] = value
    with pytest.raises(ValueError, match=r"query row 2 holds NaN or infinite values \(1 of 3 rows do\)"):
        DocumentIndex.load(directory, use_gpu=False).search(queries, 5)


# --- 4. a shipped model whose manifest cannot vouch for it ---------------------------------------------------------

ADAPTER = Path("checkpoints/final/adapter")


@pytest.fixture()
def agents_generator(tmp_path):
    import shutil

    return Path(shutil.copytree(Path(__file__).parents[1] / "weights" / "generator_agents_tiny", tmp_path / "g"))


def _tamper(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, named", [
    (lambda text: text[: len(text) // 2], r"line \d+ column \d+: not valid JSON \(truncated\?\)"),
    (lambda text: "", r"line 1 column 1: not valid JSON \(truncated\?\)"),
    (lambda text: '{"command": "python train.py"}', r"lacks key\(s\) \['files'\]"),
    (lambda text: '{"files": {"base/config.json": "abc"}}', r"entries \['base/config.json'\] hold no sha256"),
    (lambda text: "[]", r"lacks key\(s\) \['files'\] \(found list\)"),
])
@pytest.mark.parametrize("part", ["base", str(ADAPTER)])
def test_a_shipped_folder_whose_manifest_cannot_be_read_is_refused(agents_generator, damage, named, part):
    from hkrag.models.phi3v.loading import ShippedFileMismatch, verify_shipped

    manifest = agents_generator / "manifest.json"
    manifest.write_text(damage(manifest.read_text()))
    _tamper(agents_generator / ADAPTER / "adapter_model.safetensors")
    with pytest.raises(ShippedFileMismatch, match=f"{manifest} cannot vouch for the shipped files \\(.*{named}"):
        verify_shipped(agents_generator / part)


@pytest.mark.parametrize("unlisted", [str(ADAPTER / "adapter_model.safetensors"), str(ADAPTER / "adapter_config.json"),
                                      "base/model.safetensors"])
def test_a_file_the_manifest_no_longer_lists_is_refused(agents_generator, unlisted):
    from hkrag.io import read_json, write_json
    from hkrag.models.phi3v.loading import ShippedFileMismatch, verify_shipped

    manifest = read_json(agents_generator / "manifest.json")
    del manifest["files"][unlisted]
    write_json(agents_generator / "manifest.json", manifest)
    _tamper(agents_generator / unlisted)
    with pytest.raises(ShippedFileMismatch, match=f"{agents_generator / unlisted} is not listed in "):
        verify_shipped(agents_generator / Path(unlisted).parent)


@pytest.mark.parametrize("extra", [ADAPTER / "adapter_model.bin", ADAPTER / "README.md",
                                   Path("base/model-2.safetensors")])
def test_an_extra_file_beside_the_shipped_ones_is_refused(agents_generator, extra):
    from hkrag.models.phi3v.loading import ShippedFileMismatch, verify_shipped

    (agents_generator / extra).write_bytes(b"not shipped")
    with pytest.raises(ShippedFileMismatch, match=f"{agents_generator / extra} is not listed"):
        verify_shipped(agents_generator / extra.parent)


def test_the_agents_generator_with_an_unvouched_adapter_does_not_answer(agents_generator):
    from hkrag.lvlm.phi3v import Phi3VBackend
    from hkrag.models.phi3v.loading import ShippedFileMismatch

    manifest = agents_generator / "manifest.json"
    manifest.write_text(manifest.read_text()[:-40])
    _tamper(agents_generator / ADAPTER / "adapter_model.safetensors")
    with pytest.raises(ShippedFileMismatch, match="cannot vouch"):
        Phi3VBackend(base=str(agents_generator / "base"), adapter=str(agents_generator / ADAPTER), device="cpu")


# --- 6. settings that must match training ----------------------------------------------------------------------------

LATE = {"head": "late_interaction", "late_interaction": {"dim": 128, "query_augmentation": 10}}


def _trained_adapter(folder: Path, model: dict, shipped: bool) -> Path:
    """An adapter folder whose training settings are recorded as ``train.py`` (state.json) or a shipment does."""
    from dataclasses import asdict

    from hkrag.io import write_json
    from hkrag.training.checkpoint import TrainState

    adapter = folder / "checkpoints" / "final" / "adapter"
    adapter.mkdir(parents=True)
    (folder / "base").mkdir()
    (folder / "base" / "config.json").write_text("{}")
    if shipped:
        write_json(folder / "manifest.json", {"command": "python train.py", "config": {"model": model}, "files": {}})
    else:
        flat = {"model.kind": "tiny", "model.head": model.get("head", "dense"),
                **{f"model.late_interaction.{k}": v for k, v in model.get("late_interaction", {}).items()}}
        write_json(adapter.parent / "state.json", asdict(TrainState(config=flat)))
    return adapter


@pytest.mark.parametrize("shipped", [False, True])
@pytest.mark.parametrize("asked, named", [
    ({**LATE, "late_interaction": {"dim": 128, "query_augmentation": 5}},
     "model.late_interaction.query_augmentation=5"),
    ({**LATE, "late_interaction": {"dim": 128, "query_augmentation": 0}},
     "model.late_interaction.query_augmentation=0"),
    ({**LATE, "late_interaction": {"dim": 64, "query_augmentation": 10}}, "model.late_interaction.dim=64"),
    ({"head": "dense"}, "model.head=dense"),
])
def test_a_late_interaction_adapter_evaluated_with_other_head_settings_is_refused(tmp_path, shipped, asked, named):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import check_trained_head
    from hkrag.tasks.validation import ConfigError

    adapter = _trained_adapter(tmp_path / "run", LATE, shipped)
    needed = ("model.head=late_interaction model.late_interaction.dim=128 "
              "model.late_interaction.query_augmentation=10")
    with pytest.raises(ConfigError, match=rf"trained with other head settings than asked \({named}.*\): evaluate it "
                                          rf"with {needed} \(or run_dir="):
        check_trained_head(OmegaConf.create({"adapter": str(adapter), **asked}))
    check_trained_head(OmegaConf.create({"adapter": str(adapter), **LATE}))  # the trained settings pass


def test_a_dense_adapter_asked_for_late_interaction_is_refused_naming_the_head(tmp_path):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import check_trained_head
    from hkrag.tasks.validation import ConfigError

    adapter = _trained_adapter(tmp_path / "run", {"kind": "tiny"}, shipped=True)
    with pytest.raises(ConfigError, match="model.head=late_interaction.*evaluate it with model.head=dense "):
        check_trained_head(OmegaConf.create({"adapter": str(adapter), **LATE}))


@pytest.mark.parametrize("shipped", [False, True])
def test_run_dir_evaluates_a_late_interaction_run_with_its_own_head_shipped_or_not(tmp_path, shipped):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import trained_model_config

    trained = {**LATE, "late_interaction": {"dim": 96, "query_augmentation": 4}}
    _trained_adapter(tmp_path / "run", trained, shipped)
    model = trained_model_config(OmegaConf.create({"kind": "tiny", "head": "dense"}), tmp_path / "run")
    assert model.head == "late_interaction" and dict(model.late_interaction) == trained["late_interaction"]


@pytest.mark.parametrize("padding", [lambda dim: np.zeros((3, dim), np.float32), lambda dim: np.zeros((0, dim)),
                                     lambda dim: torch.zeros(12, dim)])
def test_a_query_of_padding_only_is_refused_instead_of_scoring_zero(padding):
    from hkrag.index.maxsim import MaxSimIndex

    rng = np.random.default_rng(0)
    index = MaxSimIndex.from_pages(["a", "b"], [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2)])
    good = rng.standard_normal((2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="query 'q2' is padding only .1 of 3 queries are.: no token vector"):
        index.to_run(["q1", "q2", "q3"], [good, padding(8), good], 2)
    with pytest.raises(ValueError, match="query #1 is padding only"):
        index.scores([good, padding(8)])


@pytest.mark.parametrize("how", ["same folder", "a copy", "a link"])
def test_the_seed_table_refuses_one_evaluation_given_as_two_seeds(tmp_path, how, capsys):
    import shutil

    from hkrag.tasks.seeds import main

    first = _evaluation(tmp_path / "s0", {"q1": 1.0, "q2": 0.5})
    second = {"same folder": lambda: first, "a copy": lambda: Path(shutil.copytree(first, tmp_path / "s1")),
              "a link": lambda: (tmp_path / "s1").symlink_to(first) or tmp_path / "s1"}[how]()
    error = _usage_error(main, [str(first), str(second), "--corpus", str(tmp_path / "corpus")], capsys)
    assert ("is given twice" if how != "a copy" else "hold the same evaluation") in error


def test_the_seed_table_reads_the_repositorys_committed_evaluations_from_any_folder(tmp_path, monkeypatch):
    """docs/data.md's `hkrag.tasks.seeds ... docs/regions/test_pages_s0 ...` (the committed per-query data) works
    outside the repository root; a folder found nowhere is still named as given."""
    from hkrag.tasks import seeds

    monkeypatch.chdir(tmp_path)
    read = []
    monkeypatch.setattr(seeds, "retrieval_rows", lambda runs, corpus, split: read.extend(runs) or [])
    monkeypatch.setattr(seeds, "retrieval_table", lambda rows: "")
    runs = [f"docs/regions/test_pages_s{seed}" for seed in range(3)]
    seeds.main([*runs, "--corpus", "data/synthetic/corpus"])
    root = Path(__file__).resolve().parents[1]
    assert read == [root / run for run in runs]
    with pytest.raises(SystemExit, match="2"):
        seeds.main(["docs/regions/nosuch_s0", "--corpus", "c"])


def test_the_seed_table_keeps_a_dotted_out_stem_whole(tmp_path, monkeypatch):
    """``--out seeds_h0.8`` writes seeds_h0.8.md and seeds_h0.8.json, not seeds_h0.md / .json."""
    from hkrag.tasks import seeds

    monkeypatch.setattr(seeds, "retrieval_rows", lambda runs, corpus, split: [])
    monkeypatch.setattr(seeds, "retrieval_table", lambda rows: "table")
    seeds.main(["docs/regions/test_pages_s0", "--corpus", "c", "--out", str(tmp_path / "seeds_h0.8")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["seeds_h0.8.json", "seeds_h0.8.md"]
    assert (tmp_path / "seeds_h0.8.md").read_text() == "table\n"


def test_the_seed_table_pairs_two_conditions_seed_by_seed_and_question_by_question(tmp_path, capsys):
    from hkrag.stats import crossed_interval
    from hkrag.tasks.seeds import difference_rows, main

    def seeds(name, scores):
        return [_evaluation(tmp_path / f"{name}_s{seed}", {"q1": q1, "q2": q2}) for seed, (q1, q2) in enumerate(scores)]

    runs, base = seeds("b", [(1.0, 0.5), (0.5, 0.25)]), seeds("a", [(0.5, 0.5), (0.0, 0.5)])
    (row,) = difference_rows(runs, base)
    assert (row["dataset"], row["pool"]) == ("synfine", "all")
    assert row["mean"] == pytest.approx(0.1875) and row["seeds"] == pytest.approx([0.25, 0.125])
    expected = crossed_interval([[0.5, 0.0], [0.5, -0.25]], bounds=(-1.0, 1.0))
    assert (row["low"], row["high"]) == pytest.approx((expected["low"], expected["high"]))
    main([*map(str, runs), "--vs", *map(str, base), "--corpus", "unused", "--out", str(tmp_path / "d")])
    assert "| synfine | all | +18.8 [" in capsys.readouterr().out
    assert json.loads((tmp_path / "d.json").read_text())["vs"] == [str(run) for run in base]
    error = _usage_error(main, [*map(str, runs), "--vs", str(base[0]), "--corpus", "c"], capsys)
    assert "--vs gives 1 folder(s) for 2 run(s)" in error
    other = [_evaluation(tmp_path / "c_s0", {"q1": 0.5}), _evaluation(tmp_path / "c_s1", {"q1": 0.0})]
    assert "lacks 1 (e.g. ['q2'])" in _usage_error(main, [*map(str, runs), "--vs", *map(str, other), "--corpus", "c"],
                                                   capsys)


@pytest.mark.parametrize("report", sorted(p.name for p in (Path(__file__).parents[1] / "docs" / "regions").glob(
    "diff_*.json")))
def test_every_committed_paired_difference_re_derives_from_its_per_query_data(report):
    from hkrag.tasks.seeds import difference_rows

    root = Path(__file__).resolve().parents[1]
    committed = json.loads((root / "docs" / "regions" / report).read_text())
    rows = difference_rows([root / run for run in committed["runs"]], [root / run for run in committed["vs"]])
    numbers = ("mean", "low", "high", "se", "df")
    assert [(r["dataset"], r["pool"], r["method"]) for r in rows] == [
        (r["dataset"], r["pool"], r["method"]) for r in committed["rows"]]
    assert [v for r in rows for v in [r[k] for k in numbers] + r["seeds"]] == pytest.approx(
        [v for r in committed["rows"] for v in [r[k] for k in numbers] + r["seeds"]])


# --- 8. still open: resumes, generator.top_k, undecodable questions, empty pre-training text ------------------------


def _train_config(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("override, named", [
    ("model.lora.r=8", "model.lora.r=8, but model.adapter=.* holds model.lora.r=16"),
    ("model.lora.r=64", "model.lora.r=64, but"),
    ("model.lora.alpha=8", "model.lora.alpha=8, but .* holds model.lora.alpha=32"),
    ("model.lora.dropout=0.1", "model.lora.dropout=0.1, but .* holds model.lora.dropout=0.0"),
    ("model.lora.target_modules=[qkv_proj]", r"model.lora.target_modules=\['qkv_proj'\], but"),
])
def test_training_on_an_adapter_with_other_lora_settings_is_refused(override, named):
    from hkrag.tasks.common import build_retriever
    from hkrag.tasks.validation import ConfigError

    cfg = _train_config(override)
    with pytest.raises(ConfigError, match=named + ".*a continued adapter keeps its own LoRA settings"):
        build_retriever(cfg.model)
    assert build_retriever(_train_config().model).model.peft_config["default"].r == 16  # its own settings pass


def test_resuming_train_py_with_another_lora_rank_is_refused_and_leaves_the_run_as_it_was(tmp_path):
    from hkrag.tasks.training import run_training
    from hkrag.tasks.validation import ConfigError

    run = tmp_path / "run"
    settings = tiny_training_overrides(tmp_path / "data", run)
    run_training(_train_config(*settings), run)
    before = {path: path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()}
    for resume in ("resume=latest", f"resume={run / 'checkpoints' / 'step-1'}"):
        with pytest.raises(ConfigError, match="model.lora.r=8, but model.adapter="):
            run_training(_train_config(*settings, resume, "model.lora.r=8"), run)
    assert {path: path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()} == before


@pytest.mark.parametrize("resume", [True, False])
def test_a_trace_without_its_rag_config_is_not_resumed(tmp_path, resume):
    from omegaconf import OmegaConf

    from hkrag.tasks.rag import prepare_run_dir

    part = tmp_path / "trace" / "part-00000.jsonl"
    part.parent.mkdir()
    part.write_text('{"query_id": "q1"}\n')
    cfg = OmegaConf.create({"task": {"name": "rag"}, "rag": {"resume": resume}})
    if resume:
        with pytest.raises(ValueError, match=r"trace holds answers but .*rag_config.json is missing: nothing vouches "
                                             "for the settings they were made with"):
            prepare_run_dir(cfg, tmp_path)
        assert part.read_text() == '{"query_id": "q1"}\n' and not (tmp_path / "rag_config.json").exists()
    else:  # starting over was asked for
        prepare_run_dir(cfg, tmp_path)
        assert not part.exists() and (tmp_path / "rag_config.json").is_file()


@pytest.mark.parametrize("override, named", [
    ("generator.top_k=0", "generator.top_k=0: expected an integer >= 1"),
    ("generator.top_k=-1", "generator.top_k=-1: expected an integer >= 1"),
    ("generator.top_k=1.5", "generator.top_k=1.5: expected an integer >= 1"),
    ("generator_training.max_queries=0", "generator_training.max_queries=0: expected an integer >= 1 or null"),
    ("generator_training.optim.batch_size=0", "generator_training.optim.batch_size=0: expected an integer >= 1"),
])
def test_generator_training_refuses_a_top_k_or_query_cap_below_one(tmp_path, override, named):
    from hkrag.tasks.generator_training import run_generator_training
    from hkrag.tasks.validation import ConfigError

    cfg = _train_config("experiment=generator_agents_tiny", override, f"paths.data_dir={tmp_path / 'data'}")
    with pytest.raises(ConfigError, match=re.escape(named)):
        run_generator_training(cfg, tmp_path / "run")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def _undecodable(good: list[str], bad_row: int):
    """A string array whose row ``bad_row`` holds bytes that are not UTF-8 (Arrow does not check on write)."""
    import pyarrow as pa

    data = b"".join(b"\xff\xfe" if i == bad_row else text.encode() for i, text in enumerate(good))
    lengths = [2 if i == bad_row else len(text.encode()) for i, text in enumerate(good)]
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32()).buffers()[1]
    return pa.Array.from_buffers(pa.string(), len(good), [None, offsets, pa.py_buffer(data)])


@pytest.mark.parametrize("column, row", [("query", 1), ("query", 0), ("answers", 2), ("relevant_doc_ids", 1)])
def test_a_question_or_answer_that_is_not_utf8_names_the_file_and_row(tmp_path, column, row):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hkrag.data.opendocvqa import DataError, load_qa

    n = 3
    columns = {"query_id": pa.array([f"q{i}" for i in range(n)]),
               "query": pa.array([f"What is {i}?" for i in range(n)]), "answers": pa.array([["x"]] * n),
               "relevant_doc_ids": pa.array([["d1"]] * n)}
    strings = _undecodable(["What is 0?", "What is 1?", "What is 2?"] if column == "query" else ["x", "d1", "y"], row)
    if column == "query":
        columns["query"] = strings
    else:
        columns[column] = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), strings)
    path = tmp_path / "data" / "test-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table(columns), path)
    with pytest.raises(DataError, match=rf"{path}\): row {row} \(query_id 'q{row}'\), column '{column}' is not UTF-8 "
                                        r"text \(invalid start byte at byte 0\)"):
        load_qa(tmp_path, None, "test")


@pytest.mark.parametrize("texts", [[None, None], ["", "  "], [None, "\n\t"]])
def test_pretraining_on_text_empty_everywhere_names_the_column(texts):
    from test_bad_input_more import corpus_with_texts

    from hkrag.data.opendocvqa import DataError
    from hkrag.data.pairs import pretraining_pairs

    with pytest.raises(DataError, match=r"pre\[docstruct/train\]: column 'query' is empty on every one of its 2 pages"):
        pretraining_pairs(corpus_with_texts(texts), column="query")
