"""What a retriever's page embedding says about each page: a linear read-out of every field the built-in corpus
draws (title, colour label, value, source, code, year, page number), fitted on the training pages' embeddings and
scored on the test pages'. The generator started from a reader can answer what its embedding names (docs/training.md
"The generator reads codes and colours").

    python bench/reader_probe.py weights/reader_tiny

A multinomial logistic regression per field (full-batch L-BFGS, L2 1e-3) on the L2-normalised document embeddings;
accuracy on the 120 test pages against the most frequent test value's share. ``--siblings`` adds a second reading: a
query made from a test page's fields (``"{title} {value}%"``) against the embeddings of its document's pages (the
pages sharing its title): the share it ranks first, against chance (one over the document's pages), i.e. whether
the embedding carries the field as a query names it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import machine

from hkrag.data.opendocvqa import ALL_POOL, load_corpus
from hkrag.retriever import Phi3VRetriever
from hkrag.tasks.common import FINAL_ADAPTER, resolve_run_dir

FIELDS = ("label", "title", "value", "source", "code", "year", "page_no")


def embed(retriever: Phi3VRetriever, corpus_source: Path, config: str, split: str) -> tuple[list[str], torch.Tensor]:
    corpus = load_corpus(corpus_source, config, split)
    pages = [corpus[i] for i in range(len(corpus))]
    with torch.no_grad():
        embeddings = retriever.encode_documents([page.image for page in pages], batch_size=16, progress=True)
    return [page.doc_id for page in pages], embeddings.float()


def read_out(train: torch.Tensor, train_labels: list[str], test: torch.Tensor, test_labels: list[str]) -> float:
    """Test accuracy of a logistic regression from embeddings to labels (unseen test labels count as wrong)."""
    classes = sorted(set(train_labels))
    index = {label: i for i, label in enumerate(classes)}
    targets = torch.tensor([index[label] for label in train_labels])
    head = torch.nn.Linear(train.shape[1], len(classes))
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(train), targets) + 1e-3 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    predicted = [classes[i] for i in head(test).argmax(1).tolist()]
    return sum(p == t for p, t in zip(predicted, test_labels)) / len(test_labels)


def sibling_top1(retriever: Phi3VRetriever, ids: list[str], pages: torch.Tensor, fields: dict[str, dict],
                 template: str) -> tuple[float, float]:
    """Share of the pages ``ids`` that the query ``template`` fills from their fields ranks first among the pages of
    their document (same id up to ``-p<n>``), and the chance share."""
    queries = retriever.encode_queries([template.format(**fields[i]) for i in ids]).float()
    scores = queries @ pages.T
    documents = [doc_id.rsplit("-p", 1)[0] for doc_id in ids]
    hits = chance = 0.0
    for row, document in enumerate(documents):
        members = [j for j, other in enumerate(documents) if other == document]
        hits += max(members, key=lambda j: scores[row, j].item()) == row
        chance += 1 / len(members)
    return hits / len(ids), chance / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a train.py run of the tiny retriever (base/ + final adapter)")
    parser.add_argument("--data", type=Path, default=Path("data/synthetic"), help="the built-in corpus's folder")
    parser.add_argument("--siblings", nargs="*", default=[], metavar="TEMPLATE",
                        help="query templates over the page fields, e.g. '{title} {value}%%' '{title} {code}'")
    args = parser.parse_args()
    args.run = resolve_run_dir(args.run)  # weights/reader_tiny from any folder, as eval.py's run_dir=
    torch.manual_seed(0)
    retriever = Phi3VRetriever.from_pretrained(str(args.run / "base"), adapter=str(args.run / FINAL_ADAPTER),
                                               num_crops=None, dtype=torch.float32).eval()
    fields = {row["doc_id"]: row for row in map(json.loads, (args.data / "pages.jsonl").read_text().splitlines())}
    train_ids, train = embed(retriever, args.data / "corpus", "default", "train")
    test_ids, test = embed(retriever, args.data / "corpus", ALL_POOL, "test")
    print(f"machine: {machine()}; {args.run}: {len(train_ids)} training pages, {len(test_ids)} test pages\n")
    print("| field | classes | read-out accuracy | most frequent |\n|---|---|---|---|")
    for name in FIELDS:
        train_labels = [str(fields[i][name]) for i in train_ids]
        test_labels = [str(fields[i][name]) for i in test_ids]
        majority = max(test_labels.count(label) for label in set(test_labels)) / len(test_labels)
        accuracy = read_out(train, train_labels, test, test_labels)
        print(f"| {name} | {len(set(train_labels))} | {100 * accuracy:.1f} | {100 * majority:.1f} |")
    if args.siblings:
        print("\n| query (test pages) | ranked first among its document's pages | chance |\n|---|---|---|")
    for template in args.siblings:
        top1, chance = sibling_top1(retriever, test_ids, test, fields, template)
        print(f"| `{template}` | {100 * top1:.1f} | {100 * chance:.1f} |")


if __name__ == "__main__":
    main()
