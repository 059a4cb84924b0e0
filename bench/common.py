"""Shared benchmark plumbing: the wikitext-2 data protocol and JSON output."""
from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def wikitext_dir() -> Path:
    """The wikitext-2 folder (valid.txt, test.txt): KVCALIB_WIKITEXT as it is when asked -- read on every call, so a
    setting made after this module was imported counts (a test's, or a caller's) -- else ../shared/data/wikitext-2
    beside the repository."""
    folder = Path(os.environ.get("KVCALIB_WIKITEXT") or DEFAULT_WIKITEXT)
    if not (folder / "valid.txt").is_file():
        raise SystemExit(f"bench: wikitext-2 not found at {folder} (set KVCALIB_WIKITEXT to the folder "
                         f"holding valid.txt and test.txt)")
    return folder


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
