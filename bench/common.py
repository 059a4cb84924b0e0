"""Shared benchmark plumbing: the wikitext-2 data protocol and JSON output."""
from __future__ import annotations

import json
import os
from pathlib import Path

WIKITEXT = Path(os.environ.get("KVCALIB_WIKITEXT", Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"))


def wikitext_dir() -> Path:
    if not (WIKITEXT / "valid.txt").is_file():
        raise SystemExit(f"bench: wikitext-2 not found at {WIKITEXT} (set KVCALIB_WIKITEXT to the folder "
                         f"holding valid.txt and test.txt)")
    return WIKITEXT


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
