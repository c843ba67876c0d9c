"""mkdocs hooks: the repository's README.md as a page of the site.

mkdocs reads only docs/, while the README sits at the repository's root and links into docs/
(`docs/cli.md`); docs/index.md links back to it (`../README.md`). Both read right on GitHub.
For the site, the README is added as the page `readme.md` with its `docs/` prefixes dropped,
and the pages' links to `../README.md` (any depth) point at that page instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parents[2] / "README.md"
PAGE = "readme.md"


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=README.read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == PAGE:
        return re.sub(r"\]\(docs/", "](", markdown)
    depth = page.file.src_uri.count("/")
    return markdown.replace("](" + "../" * (depth + 1) + "README.md",
                            "](" + "../" * depth + PAGE)
