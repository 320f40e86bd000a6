"""Bad input from the wild, one test per failure family: each is handled correctly or fails naming the input.

Families: images (ImageError), data sets (DataError), PDFs (PdfError), writes (WriteError),
embedding shards (ShardError), model checkpoints and run folders (CheckpointNotFoundError,
FileNotFoundError), over-long queries.
"""

import errno
import io
import logging
import os
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from hkrag.data.collators import RetrieverCollator
from hkrag.data.images import ImageError, open_image
from hkrag.data.opendocvqa import (
    CORPUS_FEATURES,
    QA_FEATURES,
    Corpus,
    DataError,
    QAExample,
    load_corpus,
    load_qa,
)
from hkrag.data.pairs import TrainingPair
from hkrag.data.pdf import PdfError, ingest, render_pdf, render_scale
from hkrag.data.writer import save_split
from hkrag.index.shards import ShardError, config_hash, encode_corpus, load_shards
from hkrag.io import WriteError, write_json
from hkrag.models.phi3v import CheckpointNotFoundError, tiny_phi3v
from hkrag.retrieval.evaluation import (
    EmbeddingCache,
    RetrievalEvalConfig,
    embed_corpus,
    evaluate_retrieval,
    pool_embeddings,
)
from hkrag.retriever import LoraSettings, Phi3VRetriever, weights_fingerprint
from hkrag.tasks.common import FINAL_ADAPTER, check_pools, trained_model_config
from hkrag.training.checkpoint import TrainState
from hkrag.training.trainer import PairDataset

sys.path.insert(0, str(Path(__file__).parent))
from test_pdf import ONE_PAGE, minimal_pdf  # noqa: E402


def png(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=save.pop("format", "PNG"), **save)
    return buffer.getvalue()


def corpus_of(pages: dict[str, Image.Image], name: str = "pool") -> Corpus:
    rows = {"doc_id": list(pages), "image": [{"bytes": png(im), "path": None} for im in pages.values()]}
    return Corpus(datasets.Dataset.from_dict(rows, features=CORPUS_FEATURES), name=name)


def qa_row(query_id, relevant="d1", answers=("x",)) -> dict:
    return {"query_id": query_id, "query": "What?", "answers": answers, "relevant_doc_ids": relevant, "evidence": None}


# --- images -------------------------------------------------------------------------------------


def test_images_exif_frames_and_paths(tmp_path, caplog):
    upright = Image.new("RGB", (40, 20), "white")
    upright.paste((255, 0, 0), (0, 0, 10, 10))  # red square at the top-left
    sideways = upright.transpose(Image.Transpose.ROTATE_90)  # stored 20x40, to be shown rotated 270
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    image = open_image(png(sideways, format="JPEG", exif=exif.tobytes(), quality=95), "scan#p1")
    assert image.size == (40, 20)
    assert np.abs(np.asarray(image)[2, 2].astype(int) - [255, 0, 0]).max() < 40

    frames = [Image.new("L", (16, 16), v) for v in (0, 128, 255)]
    tiff = io.BytesIO()
    frames[0].save(tiff, format="TIFF", save_all=True, append_images=frames[1:])
    with caplog.at_level(logging.WARNING, logger="hkrag.data.images"):  # caplog listens on the root logger
        assert open_image(tiff.getvalue(), "fax.tif").getpixel((0, 0)) == 0
        save_split([{"doc_id": "scan.tif", "image": Image.open(tiff)}], tmp_path / "scans", "default", "train",
                   CORPUS_FEATURES)  # an in-memory image: encoding keeps its first frame
    assert "document 'fax.tif': image has 3 frames (multi-page or animated); only the first is used" in caplog.text
    assert "document 'scan.tif': image has 3 frames (multi-page or animated); only the first is stored" in caplog.text

    (tmp_path / "page.png").mkdir()
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    bad_paths = {tmp_path / "page.png": "is a directory, not a file", tmp_path / "loop": "is a symbolic link loop"}
    for path, problem in bad_paths.items():
        with pytest.raises(ImageError, match=f"'doc': image path {problem}: {path}"):
            open_image(path, "doc")


def test_page_the_model_cannot_encode_is_named(tmp_path):
    corpus = corpus_of({"p0": Image.new("RGB", (60, 40), "white"), "p1": Image.new("RGB", (500, 2), "white")})
    retriever = Phi3VRetriever.tiny(num_crops=1)
    cfg = RetrievalEvalConfig("qa", "corpus", ["x"], doc_batch_size=2)
    refused = r"document 'p1': cannot be encoded: image aspect ratio 250:1 \(500x2\)"
    with pytest.raises(ImageError, match=refused):
        embed_corpus(retriever, corpus, tmp_path, cfg, {"model": "tiny", "config_hash": "x"})
    with pytest.raises(ImageError, match=refused):  # training: the page a batch draws
        PairDataset([TrainingPair("q1", "a query", ("p1",))], corpus)[0]


# --- data sets ------------------------------------------------------------------------------------

STRING_QA = datasets.Features({k: datasets.Value("string") for k in ("query_id", "query", "answers",
                                                                     "relevant_doc_ids")})


def test_data_sets_strings_nulls_empty_splits_and_cards(tmp_path):
    save_split([qa_row("q1", relevant="42", answers="yes")], tmp_path / "str", "default", "train", STRING_QA)
    (example,) = load_qa(tmp_path / "str")
    assert (example.answers, example.relevant_doc_ids) == (("yes",), ("42",))  # not ('4', '2')

    save_split([qa_row("q1"), qa_row(None)], tmp_path / "null", "default", "train", QA_FEATURES)
    with pytest.raises(DataError, match=r"null\[default/train\]: row 1 has a null or empty query_id"):
        load_qa(tmp_path / "null")
    save_split([{"doc_id": None, "image": Image.new("RGB", (4, 4))}], tmp_path / "pages", "default", "train",
               CORPUS_FEATURES)
    with pytest.raises(DataError, match=r"pages\[default/train\]: row 0 has a null or empty doc_id"):
        load_corpus(tmp_path / "pages")

    # empty splits: as save_split writes them, a zero-row table written by pyarrow, a 0-byte file
    for config, empty in (("chartqa", None), ("slidevqa", QA_FEATURES.arrow_schema.empty_table()), ("dude", b"")):
        path = save_split([], tmp_path / "empty", config, "test", QA_FEATURES)
        if isinstance(empty, bytes):
            path.write_bytes(empty)
        elif empty is not None:
            pq.write_table(empty, path)
        with pytest.raises(DataError, match=rf"empty\[{config}/test\] is empty: split 'test' of config '{config}' has "
                                            "no rows"):
            load_qa(tmp_path / "empty", config, "test")
    path = save_split([], tmp_path / "pages", "all", "test", CORPUS_FEATURES)
    pq.write_table(CORPUS_FEATURES.arrow_schema.empty_table(), path)
    with pytest.raises(DataError, match=r"pages\[all/test\] is empty: split 'test' of config 'all' has no rows"):
        load_corpus(tmp_path / "pages", "all", "test")

    (tmp_path / "str" / "README.md").write_text("---\nconfigs: [\n---\n")
    with pytest.raises(DataError, match=r"str\[default/train\] could not be loaded: README.md has malformed YAML"):
        load_qa(tmp_path / "str")
    with pytest.raises(DataError, match=f"{tmp_path / 'str' / 'README.md'}: malformed YAML front matter"):
        save_split([qa_row("q1")], tmp_path / "str", "default", "train", QA_FEATURES)


def test_a_doc_id_naming_other_pages_in_a_pool_and_in_all_is_refused(tmp_path):
    red, blue, green = (Image.new("RGB", (8, 8), c) for c in ("red", "blue", "lime"))
    assert png(red) != png(red, compress_level=0)  # the same page, other bytes

    def pool(config: str, pages: dict[str, bytes]) -> None:
        rows = [{"doc_id": doc_id, "image": {"bytes": data, "path": None}} for doc_id, data in pages.items()]
        save_split(rows, tmp_path / "corpus", config, "test", CORPUS_FEATURES)

    pool("slidevqa", {"a": png(red), "c": png(blue)})
    pool("chartqa", {"a": png(red), "b": png(blue)})
    pool("all", {"a": png(red, compress_level=0), "b": png(green), "c": png(blue)})
    cfg = RetrievalEvalConfig("qa", str(tmp_path / "corpus"), ["slidevqa", "chartqa"])
    check_pools(replace(cfg, datasets=["slidevqa"]))  # 'a' is the same page in both, stored differently
    check_pools(replace(cfg, pools=["single"]))  # nothing is compared when `all` is not evaluated
    corpus = re.escape(str(tmp_path / "corpus"))
    with pytest.raises(DataError, match=rf"doc_id 'b' holds different pages in {corpus}\[chartqa/test\] and "
                                        rf"{corpus}\[all/test\]; a doc_id must name one page"):
        check_pools(cfg)


def test_loading_writes_nothing_into_the_data_folder(tmp_path):
    save_split([qa_row("q1")], tmp_path / "qa", "default", "train", QA_FEATURES)
    before = sorted(tmp_path.rglob("*"))
    assert [ex.query_id for ex in load_qa(tmp_path / "qa")] == ["q1"]
    assert sorted(tmp_path.rglob("*")) == before  # so a read-only mount loads


# --- PDFs ------------------------------------------------------------------------------------------


class Pages:
    """A stand-in progress bar recording its total and position."""

    total, n = 0, 0

    def update(self, k):
        self.n += k

    def refresh(self):
        pass


def test_pdfs_that_are_not_pdfs_and_huge_pages(tmp_path, caplog):
    (tmp_path / "dir.pdf").mkdir()
    os.symlink(tmp_path / "loop.pdf", tmp_path / "loop.pdf")
    (tmp_path / "none.pdf").write_bytes(minimal_pdf([b"<< /Type /Catalog >>"]))
    problems = {"dir.pdf": "path is a directory", "loop.pdf": "path is a symbolic link loop",
                "none.pdf": "the PDF has no pages"}
    for name, problem in problems.items():
        with pytest.raises(PdfError, match=f"{tmp_path / name}: {problem}"):
            render_pdf(tmp_path / name)

    huge = [*ONE_PAGE[:2], ONE_PAGE[2].replace(b"[0 0 100 100]", b"[0 0 14400 14400]")]
    (tmp_path / "huge.pdf").write_bytes(minimal_pdf(huge))
    progress = Pages()
    with caplog.at_level(logging.INFO, logger="hkrag.data.pdf"):
        ((_, page),) = render_pdf(tmp_path / "huge.pdf", dpi=144, max_pixels=250_000, progress=progress)
    width, height = Image.open(io.BytesIO(page)).size
    assert width * height <= 250_000 and width >= 495  # sqrt(250000) = 500, minus rounding
    assert "huge.pdf page 1 is 14400x14400 pt: rendered at 2 dpi instead of 144" in caplog.text
    assert (progress.total, progress.n) == (1, 1)
    assert render_scale(100, 50, 144, 10**9) == 2.0  # small pages keep their dpi


def test_failed_reingest_keeps_the_previous_corpus(tmp_path, monkeypatch):
    (tmp_path / "a.pdf").write_bytes(minimal_pdf(ONE_PAGE))
    ingest([tmp_path / "a.pdf"], tmp_path / "corpus", dpi=36)
    (tmp_path / "b.pdf").write_bytes(minimal_pdf(ONE_PAGE))

    def disk_full(self, table, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", disk_full)
    target = tmp_path / "corpus" / "default" / "train-00000-of-00001.parquet"
    with pytest.raises(WriteError, match=f"could not write {target}: No space left on device"):
        ingest([tmp_path / "a.pdf", tmp_path / "b.pdf"], tmp_path / "corpus", dpi=36)
    monkeypatch.undo()
    assert load_corpus(tmp_path / "corpus").doc_ids == ["a.pdf#p1"]
    assert [p.name for p in target.parent.iterdir()] == [target.name]


# --- embedding shards and the weights they come from ------------------------------------------------


def test_corrupt_shard_files_are_named(tmp_path):
    items = [{"doc_id": f"d{i}"} for i in range(6)]
    manifest = {"model": "m", "config_hash": "h"}
    for case, (name, damage) in {
        "npy": ("shard-00000.npy", lambda p: p.write_bytes(p.read_bytes()[:90])),
        "json": ("shard-00001.json", lambda p: p.write_text('{"shard": 1, "ids": [')),
        "manifest": ("manifest.json", lambda p: p.write_text("")),
    }.items():
        out = tmp_path / case
        encode_corpus(items, lambda rows: np.eye(len(rows), 4), out, shard_size=3, manifest=manifest, progress=False)
        damage(out / name)
        with pytest.raises(ShardError, match=f"{out / name}: unreadable or "):
            load_shards(out)


def test_stale_embeddings_of_another_model_are_refused(tmp_path):
    pages = corpus_of({"a": Image.new("RGB", (56, 56), "red"), "b": Image.new("RGB", (56, 56), "blue")})
    qa = [QAExample("q1", "red?", ("x",), ("a",))]
    cfg = RetrievalEvalConfig("qa", "corpus", ["set"], pools=["single"])
    seeds = [Phi3VRetriever.tiny(num_crops=1, seed=s) for s in (0, 0, 1)]
    assert weights_fingerprint(seeds[0]) == weights_fingerprint(seeds[1]) != weights_fingerprint(seeds[2])
    for retriever in seeds[:2]:  # the same weights resume from the shards
        evaluate_retrieval(retriever, cfg, tmp_path, {"model": "tiny"}, lambda *a: qa, lambda *a: pages)
    with pytest.raises(ShardError, match="different run.*weights: on disk"):
        evaluate_retrieval(seeds[2], cfg, tmp_path, {"model": "tiny"}, lambda *a: qa, lambda *a: pages)


class MeanColour:
    """Embeds a page as its mean RGB colour; counts the pages it embedded."""

    embedded = 0

    def encode_documents(self, images, batch_size):
        self.embedded += len(images)
        return torch.tensor(np.stack([np.asarray(im.convert("RGB"), dtype=np.float32).mean((0, 1)) for im in images]))


def test_same_doc_id_with_another_image_in_another_pool_gets_its_own_embedding(tmp_path, caplog):
    red, green, blue = (Image.new("RGB", (8, 8), c) for c in ("red", "lime", "blue"))
    cfg = RetrievalEvalConfig("qa", "corpus", ["set"])
    identity = {"model": "mean", "config_hash": config_hash("mean")}
    retriever, cache = MeanColour(), EmbeddingCache()
    single = pool_embeddings(retriever, corpus_of({"a": red, "b": blue}), tmp_path / "s", cfg, identity, cache)
    with caplog.at_level(logging.WARNING, logger="hkrag.retrieval.evaluation"):
        pool = corpus_of({"a": green, "b": blue, "c": red}, name="all-pool")
        vectors = pool_embeddings(retriever, pool, tmp_path / "all", cfg, identity, cache)
    assert vectors[0].tolist() == [0, 255, 0] and single[0].tolist() == [255, 0, 0]
    assert "all-pool: 1 doc_id(s) hold other images than in a pool evaluated before (e.g. ['a'])" in caplog.text
    embedded = retriever.embedded
    again = pool_embeddings(retriever, corpus_of({"b": blue, "c": red}), tmp_path / "x", cfg, identity, cache)
    assert retriever.embedded == embedded and again.tolist() == [[0, 0, 255], [255, 0, 0]]  # served from the cache


# --- model checkpoints and queries ----------------------------------------------------------------


def test_unloadable_checkpoints_name_the_file_or_id(tmp_path):
    from omegaconf import OmegaConf

    from hkrag.tasks.common import build_retriever

    Phi3VRetriever.tiny(lora=LoraSettings(r=2)).model.save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    model, processor = tiny_phi3v(num_crops=1)
    with pytest.raises(CheckpointNotFoundError, match=f"{weights} is truncated or corrupt"):
        Phi3VRetriever.wrap(model, processor, adapter=tmp_path / "adapter")
    cfg = OmegaConf.create({"kind": "phi3v", "base": str(tmp_path / "no-model"), "adapter": None, "num_crops": 4,
                            "dtype": "float32", "gradient_checkpointing": False})
    with pytest.raises(CheckpointNotFoundError, match=f"'{tmp_path / 'no-model'}'(.|\n)*model.base=/local/path"):
        build_retriever(cfg, trainable=False)


def test_a_run_folder_without_its_base_is_refused_naming_what_is_missing(tmp_path):
    from omegaconf import OmegaConf

    run, hub = tmp_path / "run", "microsoft/Phi-3-vision-128k-instruct"
    (run / FINAL_ADAPTER).mkdir(parents=True)
    state = run / FINAL_ADAPTER.parent / "state.json"
    model = OmegaConf.create({"kind": "phi3v", "base": hub, "adapter": None})
    incomplete = rf"run folder {re.escape(str(run))} is incomplete: "
    with pytest.raises(FileNotFoundError, match=incomplete + r"it has no base/ and its .*state.json cannot tell"):
        trained_model_config(model, run)
    write_json(state, asdict(TrainState(config={"model.kind": "tiny", "model.seed": 0})))
    with pytest.raises(FileNotFoundError, match=incomplete + re.escape(f"{run / 'base' / 'config.json'} is missing")):
        trained_model_config(model, run)
    write_json(state, asdict(TrainState(config={"model.kind": "phi3v", "model.base": hub})))  # a hub base: complete
    assert trained_model_config(model, run).adapter == str(run / FINAL_ADAPTER)


def test_over_long_query_is_truncated_to_the_context_with_one_warning(caplog):
    _, processor = tiny_phi3v(texts=["word"], num_crops=1)
    collator = RetrieverCollator(processor, max_query_length=12)
    with caplog.at_level(logging.WARNING, logger="hkrag.data.collators"):
        batch = collator.queries(["word", "word " * 40], ids=["q1", "q2"])
        collator.queries(["word " * 30], ids=["q3"])
    assert batch["input_ids"].shape == (2, 12)
    assert batch["input_ids"][1, -1] == processor.tokenizer.eos_token_id and batch["attention_mask"][1].all()
    assert caplog.text.count("over the model's context of 12") == 1 and "query q2 is " in caplog.text
    retriever = Phi3VRetriever.tiny(num_crops=1)
    assert retriever.collator.max_query_length == retriever.backbone.config.max_position_embeddings
