"""A self-contained HTML page around PNGs (KFP's HTML artifacts and MLflow show it without other files)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Sequence


def png_page(title: str, png_paths: str | Path | Sequence[str | Path], preformatted: str = "") -> str:
    """`title` as a heading, optional preformatted text (a Markdown table, say), then the image(s) inline."""
    paths = [png_paths] if isinstance(png_paths, (str, Path)) else list(png_paths)
    text = f"<pre>{html.escape(preformatted)}</pre>" if preformatted else ""
    images = "".join(f'<img alt="{html.escape(title)}" src="data:image/png;base64,'
                     f'{base64.b64encode(Path(path).read_bytes()).decode("ascii")}"/>' for path in paths)
    return f"<html><body><h3>{html.escape(title)}</h3>{text}{images}</body></html>\n"
