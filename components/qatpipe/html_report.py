"""A self-contained HTML page around a PNG (KFP's HTML artifacts and MLflow show it without other files)."""

from __future__ import annotations

import base64
import html
from pathlib import Path


def png_page(title: str, png_path: str | Path, preformatted: str = "") -> str:
    """`title` as a heading, optional preformatted text (a Markdown table, say), then the image inline."""
    data = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    text = f"<pre>{html.escape(preformatted)}</pre>" if preformatted else ""
    return (f"<html><body><h3>{html.escape(title)}</h3>{text}"
            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"/></body></html>\n')
