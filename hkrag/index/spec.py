"""What FAISS index to build: named kinds, ``faiss.index_factory`` specs and ``tuned:<dir>``.

:class:`IndexSpec` parses ``flat``, ``sq8``, ``fp16``, ``ivfpq:nlist=…,m=…,nbits=…,nprobe=…``,
``faiss:<factory>[;<search parameters>]`` (as :mod:`hkrag.index.tuning` writes them) and
``tuned:<dir>`` (the spec and tuned parameters saved with another index in its ``index.json``); see
docs/index.md, "FAISS index".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import faiss

from hkrag.io import read_json
from hkrag.ranges import INTEGER, OPTIONAL_POSITIVE, POSITIVE, PQ_BITS, Rule

KINDS = ("flat", "ivfpq", "sq8", "fp16", "faiss")
META_FILE = "index.json"
"""A saved index's description (spec, dim, count, tuning record), next to its FAISS file."""
SEARCH_COUNT = Rule(int, low=1, high=2**20)
"""Probed lists, graph candidates (``efSearch``), re-ranked pages: more than 2**20 is a typo."""
FACTORY_NUMBERS: dict[str, tuple[str, Rule]] = {
    "HNSW": ("M (graph links a node)", Rule(int, low=2, high=512)),
    "IVF": ("nlist (inverted lists)", Rule(int, low=1, high=2**24)),
    "PQ": ("m (sub-quantisers)", Rule(int, low=1, high=4096)),
}
"""The numbers of a factory string's components (``HNSW32``, ``IVF1024``, ``PQ16x8``), checked before FAISS sees
them: FAISS builds ``HNSW0`` or ``PQ16x0`` without complaint and then searches to nothing or aborts."""
SEARCH_PARAMETERS: dict[str, Rule] = {
    "nprobe": SEARCH_COUNT,
    "efSearch": SEARCH_COUNT,
    "quantizer_efSearch": SEARCH_COUNT,
    "max_codes": SEARCH_COUNT,
    "k_factor": Rule(float, low=1, high=2**10),
    "k_factor_rf": Rule(float, low=1, high=2**10),
}
"""FAISS ``ParameterSpace`` names and their ranges (FAISS casts ``efSearch=nan`` to -2**31 and searches to nothing);
other names go to FAISS, which refuses those it does not know."""


@dataclass(frozen=True)
class IndexSpec:
    """What kind of FAISS index to build.

    ``kind`` is one of ``flat`` (exact), ``ivfpq`` (inverted lists + product quantiser: ``m``
    sub-quantisers of ``nbits`` bits each, ``nlist`` lists, ``nprobe`` probed at search),
    ``sq8`` (8-bit scalar quantiser), ``fp16`` (16-bit float scalar quantiser) or ``faiss``: the
    ``faiss.index_factory`` description ``factory`` searched with the FAISS ``ParameterSpace``
    string ``params`` (e.g. ``nprobe=32,k_factor_rf=4``). ``nlist=None`` picks ``4*sqrt(n)``
    bounded by the number of training vectors.
    """

    kind: str = "flat"
    nlist: int | None = None
    m: int = 64
    nbits: int = 8
    nprobe: int = 16
    factory: str | None = None
    params: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown index kind {self.kind!r}; expected one of {KINDS}")
        if (self.kind == "faiss") != bool(self.factory):
            raise ValueError(f"a factory string goes with kind 'faiss' only ({self.kind=}, {self.factory=})")
        if self.params and self.kind != "faiss":
            raise ValueError(f"search parameters {self.params!r} apply to faiss: specs only, not {self.kind!r}")
        for name, rule in (("nlist", OPTIONAL_POSITIVE), ("m", POSITIVE), ("nbits", PQ_BITS), ("nprobe", SEARCH_COUNT)):
            rule.check(f"index setting {name}", getattr(self, name))
        if self.kind == "faiss":
            check_factory(self.factory)
            check_search_parameters(self.params)

    @classmethod
    def parse(cls, text: str | IndexSpec) -> IndexSpec:
        """Parse ``"flat"``, ``"sq8"``, ``"fp16"``, ``"ivfpq:nlist=1024,m=64,nbits=8,nprobe=32"``,
        ``"faiss:<index_factory string>[;<search parameters>]"`` or ``"tuned:<index directory>"``."""
        if isinstance(text, IndexSpec):
            return text
        kind, _, params = text.strip().partition(":")
        if kind.strip().lower() == "faiss":
            factory, _, search = params.partition(";")
            if not factory.strip():
                raise ValueError(f"{text!r}: expected faiss:<index_factory string>[;<search parameters>]")
            return cls(kind="faiss", factory=factory.strip(), params=search.strip())
        if kind.strip().lower() == "tuned":
            return cls(**read_meta(params.strip())["spec"])
        known = {f.name for f in fields(cls)} - {"kind"}
        values: dict[str, int] = {}
        for item in filter(None, params.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in known:
                raise ValueError(f"bad index parameter {item!r} in {text!r}; known: {sorted(known)}")
            values[key.strip()] = INTEGER.parse(f"index setting {key.strip()}", value.strip())
        return cls(kind=kind.strip().lower(), **values)

    def __str__(self) -> str:
        if self.kind == "faiss":
            return f"faiss:{self.factory}" + (f";{self.params}" if self.params else "")
        if self.kind != "ivfpq":
            return self.kind
        return f"ivfpq:nlist={self.nlist},m={self.m},nbits={self.nbits},nprobe={self.nprobe}"

    @property
    def metric(self) -> int:
        """FAISS metric: L2 for factory strings, inner product otherwise.

        FAISS's PCA transforms centre the data, which preserves L2 distances but not inner products
        (``(q-m)·(x-m)`` adds ``-m·x``, different per document): with METRIC_INNER_PRODUCT a
        ``PCA384,...`` index ranked 52% of the exact top-5 (60k embedding-like vectors), with L2 95%.
        On L2-normalised vectors L2 ranks exactly as inner product; scores are mapped back to it.
        """
        return faiss.METRIC_L2 if self.kind == "faiss" else faiss.METRIC_INNER_PRODUCT

    def factory_string(self) -> str:
        """The ``faiss.index_factory`` description of this spec."""
        return {
            "flat": "Flat",
            "sq8": "SQ8",
            "fp16": "SQfp16",
            "ivfpq": f"IVF{self.nlist},PQ{self.m}x{self.nbits}",
            "faiss": self.factory,
        }[self.kind]

    def default_max_train(self) -> int:
        """Training sample size: 64 vectors per IVF/PQ centroid (k-means and PQ codebooks; 40 per
        list for a factory IVF, FAISS's minimum without a warning), at least 65,536 (scalar
        quantiser ranges, PCA/OPQ rotations)."""
        if self.kind == "ivfpq":
            return 64 * max(self.nlist, 2**self.nbits)
        lists = re.search(r"IVF(\d+)", self.factory or "")
        return max(65536, 40 * int(lists.group(1))) if lists else 65536

    def resolved(self, dim: int, num_train: int) -> IndexSpec:
        """Fill in ``nlist`` and check the spec against the data it will be trained on."""
        if self.kind != "ivfpq":
            return self
        if dim % self.m:
            raise ValueError(f"ivfpq: m={self.m} must divide the vector dimension {dim}")
        nlist = self.nlist or max(1, min(int(4 * math.sqrt(num_train)), num_train // 39))
        needed = max(nlist, 2**self.nbits)
        if num_train < needed:
            raise ValueError(
                f"ivfpq: {num_train} training vectors are fewer than the {needed} centroids "
                f"(nlist={nlist}, 2**nbits={2**self.nbits}); lower nlist/nbits or use flat"
            )
        return replace(self, nlist=nlist)


def search_space(n: int, dim: int, *, prefix: str = "", codes: str = "SQ8", suffix: str = "") -> list[str]:
    """Factory strings :func:`hkrag.index.tuning.select` chooses among for ``n`` vectors of ``dim``: inverted
    lists (``IVF{nlist}``, ``nlist`` the power of two nearest ``4 sqrt(n)``), a graph over the codes
    (``HNSW32``: Malkov & Yashunin's graph, 32 links a node) and, where there are enough vectors to train
    ``4 x nlist`` lists (40 a list), inverted lists with a graph coarse quantizer (``IVF{4 nlist}_HNSW32``).
    ``prefix`` (e.g. ``PCA512,``), ``codes`` and ``suffix`` (e.g. ``,Refine(SQfp16)``) are shared by all."""
    if n < 1 or dim < 1:
        raise ValueError(f"search_space needs n >= 1 and dim >= 1, got {n=} {dim=}")
    nlist = 2 ** max(0, round(math.log2(4 * math.sqrt(n))))
    specs = [f"IVF{nlist},{codes}", f"HNSW32,{codes}"]
    if n >= 40 * 4 * nlist:
        specs.append(f"IVF{4 * nlist}_HNSW32,{codes}")
    return [f"{prefix}{spec}{suffix}" for spec in specs]


def check_factory(factory: str) -> str:
    """``factory`` if each ``HNSW<M>``, ``IVF<nlist>`` and ``PQ<m>x<nbits>`` in it is in range, else a ``ValueError``
    naming the component, the number and the allowed range."""
    for match in re.finditer(r"(HNSW|IVF|PQ)(-?[0-9.]+(?:e[0-9]+)?)(?:x(-?[0-9]+))?", factory):
        component, number, bits = match.groups()
        name, rule = FACTORY_NUMBERS[component]
        _factory_number(rule, f"{match.group(0)} in {factory!r}: {name}", number)
        if component == "PQ" and bits is not None:
            _factory_number(PQ_BITS, f"{match.group(0)} in {factory!r}: nbits (bits per code)", bits)
    return factory


def check_search_parameters(params: str) -> str:
    """``params`` (``name=value,...``, FAISS ``ParameterSpace``) if each of :data:`SEARCH_PARAMETERS` is in range."""
    for item in filter(None, (part.strip() for part in params.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"search parameter {item!r} in {params!r}: expected name=value")
        rule = SEARCH_PARAMETERS.get(name.strip())
        if rule is not None:
            rule.parse(f"search parameter {name.strip()}", value.strip())
    return params


def _factory_number(rule: Rule, what: str, text: str) -> None:
    problem = rule.problem(int(text)) if re.fullmatch(r"-?[0-9]+", text) else f"expected {rule.describe()}"
    if problem:
        raise ValueError(f"{what}={text}: {problem}")


def read_meta(directory: str | Path) -> dict:
    """The ``index.json`` of a saved index (spec, dim, count, tuning record); a damaged one is named."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no saved index at {directory!s} ({path} is missing)")
    return read_json(path, keys=("spec",))
