"""The prepared data directory: the one contract between ``moe-lit data prepare`` and its readers.

```
<out>/meta.json                  {"languages", "vocab_size", "tokens": {split: {lang: n}}, ...}
<out>/tokenizer.json             byte-level BPE (tokenizers), EOS between paragraphs
<out>/<split>/<lang>/            litdata token-chunk dataset (TokensLoader)
<out>/text/<split>/<lang>.jsonl  {"id", "doc", "pos", "text"} per paragraph, in document order
```

``id`` is the paragraph id (the same id in every language for a parallel source), ``doc`` the
document (help page, text file) it came from and ``pos`` its index within that document.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moe_lit.checkpoint import TOKENIZER_FILE
from moe_lit.errors import MoeLitError

META_FILE = "meta.json"
SPLITS = ("train", "val", "test")
FORMAT_VERSION = 1
PathLike = str | os.PathLike


def default_data_dir() -> Path:
    """``$MOE_LIT_DATA``, else ``data_cache/default`` in the source checkout (else under the cwd)."""
    if os.environ.get("MOE_LIT_DATA"):
        return Path(os.environ["MOE_LIT_DATA"])
    repo = Path(__file__).resolve().parents[2]
    root = repo if (repo / "pyproject.toml").is_file() else Path.cwd()
    return root / "data_cache" / "default"


def default_cache_dir() -> Path:
    """``$MOE_LIT_CACHE``, else ``~/.cache/moe_lit``: downloaded packages and extracted paragraphs."""
    return Path(os.environ.get("MOE_LIT_CACHE") or Path.home() / ".cache" / "moe_lit")


def tokens_dir(root: PathLike, split: str, lang: str) -> Path:
    return Path(root) / split / lang


def text_file(root: PathLike, split: str, lang: str) -> Path:
    return Path(root) / "text" / split / f"{lang}.jsonl"


def tokenizer_file(root: PathLike) -> Path:
    return Path(root) / TOKENIZER_FILE


def read_meta(root: PathLike) -> dict[str, Any]:
    """``meta.json`` of a prepared directory, or a one-line error saying how to create it."""
    path = Path(root) / META_FILE
    if not path.is_file():
        looked_at = Path(root).resolve()
        raise MoeLitError(
            f"data_dir {str(root)!r} holds no prepared data (no {looked_at / META_FILE}); "
            f"create it with: moe-lit data prepare --out {looked_at}"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise MoeLitError(
            f"data_dir {str(root)!r}: format {meta.get('format')!r}, expected {FORMAT_VERSION}; "
            f"re-run: moe-lit data prepare --out {root} --force"
        )
    return meta


def import_litdata():
    """``litdata``, imported without its PyPI version check."""
    # NOTE: litdata asks pypi.org for a newer release on every optimize() (30 s timeout when
    # offline); the switch is read once, when litdata is first imported, so it is set before.
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    import litdata

    return litdata
