"""An on-disk cache of LVLM answers, so re-running an evaluation does not pay for the same call twice.

One JSON file per answer under ``root/<2 hex>/<sha256>.json``, keyed by the request's fingerprint
(model, messages with page hashes, generation settings) plus whatever else changes the answer (server
URL, image budget). Files are written atomically (:mod:`hkrag.io`), so a reader — another thread or
another process — sees either no file or a complete one; two writers of the same key write the same
answer and the last rename wins. A corrupt file is a miss (and is overwritten), never an error.
Nothing secret is stored: only the key's ingredients named by the caller and the result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from hkrag.io import write_json

from .base import LVLMRequest, LVLMResult

log = logging.getLogger(__name__)


_WRITE_LOCK = threading.Lock()
"""Serialises this process's writes: :mod:`hkrag.io` names its temporary file per process, not per thread."""


class ResponseCache:
    """Answers on disk under ``root``; :meth:`get` marks hits ``cached=True``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def key(self, request: LVLMRequest, model: str, **context: Any) -> str:
        """SHA-256 of ``request.fingerprint(model)`` and ``context`` (e.g. ``base_url``, ``max_pixels``)."""
        payload = json.dumps({"request": request.fingerprint(model), **context}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> LVLMResult | None:
        """The stored answer for ``key`` with ``cached=True``, or ``None`` (missing or unreadable file)."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return replace(LVLMResult.from_dict(data["result"]), cached=True)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignoring unreadable LVLM cache entry %s (%s)", path, error)
            return None

    def put(self, key: str, result: LVLMResult) -> Path:
        """Store ``result`` under ``key`` (atomically); returns the file."""
        with _WRITE_LOCK:
            return write_json(self.path(key), {"key": key, "result": replace(result, cached=False).to_dict()})

    def __repr__(self) -> str:
        return f"ResponseCache({str(self.root)!r})"
