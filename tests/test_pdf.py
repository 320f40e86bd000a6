import logging
from io import BytesIO

import matplotlib
import numpy as np
import pytest
from PIL import Image

from hkrag.data.opendocvqa import load_corpus
from hkrag.data.pdf import PdfError, ingest, main, render_pdf

matplotlib.use("Agg")


def minimal_pdf(objects: list[bytes], trailer: bytes = b"") -> bytes:
    """A hand-written PDF (correct xref offsets) for cases no installed library can produce."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R %s >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer, xref)
    return bytes(out)


ONE_PAGE = [
    b"<< /Type /Catalog /Pages 2 0 R >>",
    b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
    b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 100 100] >>",
]
# Standard security handler (RC4, revision 2) whose /O and /U match no password, not even "".
ENCRYPTED = minimal_pdf(
    [*ONE_PAGE, b"<< /Filter /Standard /V 1 /R 2 /O <%s> /U <%s> /P -4 >>" % (b"ab" * 32, b"cd" * 32)],
    b"/Encrypt 4 0 R /ID [<%s> <%s>]" % (b"01" * 16, b"01" * 16),
)
NO_PAGES = minimal_pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])


@pytest.fixture(scope="module")
def pdfs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdfs")
    pages = [Image.new("RGB", size, colour) for size, colour in [((200, 300), "red"), ((300, 200), "blue")]]
    pages[0].save(root / "scan.pdf", "PDF", save_all=True, append_images=pages[1:], resolution=72)

    from matplotlib.backends.backend_pdf import PdfPages
    from matplotlib.figure import Figure

    with PdfPages(root / "figure.pdf") as pdf:
        for _ in range(3):
            figure = Figure(figsize=(2, 1))
            figure.add_axes((0, 0, 1, 1)).imshow(np.zeros((4, 4, 3)) + [0, 1, 0], interpolation="nearest")
            pdf.savefig(figure)
    full = (root / "scan.pdf").read_bytes()
    (root / "truncated.pdf").write_bytes(full[: len(full) // 2])
    (root / "encrypted.pdf").write_bytes(ENCRYPTED)
    (root / "empty.pdf").write_bytes(b"")
    (root / "nopages.pdf").write_bytes(NO_PAGES)
    (root / "copy").mkdir()
    (root / "copy" / "scan.pdf").write_bytes(full)
    return root


def test_render_pdf_pages_and_sizes(pdfs):
    pages = render_pdf(pdfs / "scan.pdf", dpi=144)
    assert [doc_id for doc_id, _ in pages] == ["scan.pdf#p1", "scan.pdf#p2"]
    images = [Image.open(BytesIO(png)) for _, png in pages]
    assert [im.size for im in images] == [(400, 600), (600, 400)]
    red = np.asarray(images[0].convert("RGB"), dtype=int)[300, 200]
    assert np.abs(red - [255, 0, 0]).max() <= 2  # PIL stores the page as JPEG


@pytest.mark.parametrize(
    "name,problem",
    [
        ("encrypted.pdf", "encrypted (password required)"),
        ("truncated.pdf", "corrupt or unreadable"),
        ("empty.pdf", "empty file (0 bytes)"),
        ("nopages.pdf", "the PDF has no pages"),
        ("missing.pdf", "file not found"),
    ],
)
def test_bad_pdfs_raise_a_clear_error(pdfs, name, problem):
    with pytest.raises(PdfError, match=name) as info:
        render_pdf(pdfs / name)
    assert info.value.problem.startswith(problem)


def test_ingest_keeps_good_files_and_reports_bad_ones(pdfs, tmp_path, caplog):
    files = ["scan.pdf", "encrypted.pdf", "figure.pdf", "truncated.pdf", "empty.pdf", "copy/scan.pdf"]
    with caplog.at_level(logging.WARNING, logger="hkrag.data.pdf"):
        report = ingest([pdfs / f for f in files], tmp_path / "corpus", dpi=72, config="mine", split="test")
    assert (report.files, report.pages) == (2, 5)
    assert {k.removeprefix(str(pdfs) + "/"): v.split(":")[0] for k, v in report.failed.items()} == {
        "encrypted.pdf": "encrypted (password required)",
        "truncated.pdf": "corrupt or unreadable",
        "empty.pdf": "empty file (0 bytes)",
        "copy/scan.pdf": f"same file name as {pdfs / 'scan.pdf'}; doc_ids would collide",
    }
    assert "4 PDFs skipped" in caplog.text
    corpus = load_corpus(tmp_path / "corpus", "mine", "test", cache_dir=str(tmp_path / "cache"))
    assert corpus.doc_ids == ["scan.pdf#p1", "scan.pdf#p2", "figure.pdf#p1", "figure.pdf#p2", "figure.pdf#p3"]
    figure = np.asarray(corpus["figure.pdf#p2"].image.convert("RGB"))
    assert figure.shape == (72, 144, 3)
    assert (figure[36, 72] == [0, 255, 0]).all()  # the embedded image, rendered


def test_cli_exit_code_depends_on_whether_anything_was_ingested(pdfs, tmp_path):
    assert main([str(pdfs / "empty.pdf"), str(pdfs / "encrypted.pdf"), "--out", str(tmp_path / "none")]) == 1
    assert not (tmp_path / "none").exists()
    assert main([str(pdfs / "scan.pdf"), str(pdfs / "empty.pdf"), "--out", str(tmp_path / "some"), "--dpi", "36"]) == 0
    corpus = load_corpus(tmp_path / "some", cache_dir=str(tmp_path / "cache"))
    assert corpus.doc_ids == ["scan.pdf#p1", "scan.pdf#p2"] and corpus[0].image.size == (100, 150)
