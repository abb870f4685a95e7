"""A self-contained HTML page around PNGs (KFP's HTML artifacts and MLflow show it without other files)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Sequence


def png_page(title: str, png_paths: str | Path | Sequence[str | Path], preformatted: str = "") -> str:
    """`title` as a heading, optional preformatted text (a Markdown table, say), then the image(s) inline."""
    paths = [png_paths] if isinstance(png_paths, (str, Path)) else list(png_paths)
    return sections_page(title, [("", preformatted, paths)])


def sections_page(title: str, sections: Sequence[tuple[str, str, Sequence[str | Path]]]) -> str:
    """`title` as a heading, then per (heading, preformatted text, PNGs) section its heading (when not empty),
    text and images inline: several reports on one page (the sensitivity stage's models)."""
    parts = []
    for heading, preformatted, pngs in sections:
        parts.append(f"<h4>{html.escape(heading)}</h4>" if heading else "")
        parts.append(f"<pre>{html.escape(preformatted)}</pre>" if preformatted else "")
        parts += [f'<img alt="{html.escape(heading or title)}" src="data:image/png;base64,'
                  f'{base64.b64encode(Path(path).read_bytes()).decode("ascii")}"/>' for path in pngs]
    return f"<html><body><h3>{html.escape(title)}</h3>{''.join(parts)}</body></html>\n"
