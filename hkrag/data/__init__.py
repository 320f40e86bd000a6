"""Data: OpenDocVQA loaders, the built-in synthetic corpus, PDF ingestion, collators.

- ``opendocvqa``: reads QA sets and page corpora in the hub layout (``load_qa``, ``load_corpus``,
  ``pools``, ``qrels``).
- ``pairs``: training pairs (``training_pairs``, ``TrainingPair``).
- ``writer``: writes the hub layout (``save_split``).
- ``images``: ``open_image`` decodes and validates a page, naming the document on failure.
- ``synthetic``: a seeded corpus of chart/slide/table/infographic pages with salient and
  fine-print questions, written in the same layout (``python -m hkrag.data.synthetic``).
- ``pdf``: renders PDFs into a corpus (``python -m hkrag.data.pdf``).

Unusable data raise one error type per family, naming the input: ``opendocvqa.DataError`` (data
sets, rows), ``images.ImageError`` (pages), ``pdf.PdfError`` (PDF files). See ``docs/data.md`` and
``docs/errors.md``.
"""
