"""Sphinx extension: every internal link of the built HTML site leads somewhere.

After an HTML build it reads each page the build wrote and follows every
relative ``href`` and ``src``: the file must exist in the output, and a
``#fragment`` must be an ``id`` on the page it points to. A broken one is a
warning that names the page and the link, and ``sphinx -W`` makes it an error.
Links that leave the site (``https:``, ``mailto:``) are not followed: the build
must not need the network.

MyST already warns about a Markdown link to a page or heading it cannot find;
this check also covers what it cannot see: links in raw HTML, links to files
outside the pages (figures, downloads) and the anchors autodoc and the theme write.
"""

import html.parser
import posixpath
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


class _Page(html.parser.HTMLParser):
  """The ids a page defines and the internal links it makes."""

  def __init__(self):
    super().__init__()
    self.ids: set[str] = set()
    self.links: list[str] = []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if attrs.get("id"):
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("name"):
      self.ids.add(attrs["name"])
    for attribute in ("href", "src"):
      link = attrs.get(attribute)
      if link and not urlsplit(link).scheme and not link.startswith("//"):
        self.links.append(link)


def _read(path: Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8", errors="replace"))
  return page


def broken_links(outdir: Path) -> list[tuple[str, str, str]]:
  """``(page, link, why)`` for every internal link of the site under ``outdir`` that is broken."""
  pages = {
    path.relative_to(outdir).as_posix(): _read(path)
    for path in outdir.rglob("*.html")
    if not path.relative_to(outdir).parts[0].startswith("_")  # theme templates, not pages
  }
  broken = []
  for name, page in sorted(pages.items()):
    for link in page.links:
      parts = urlsplit(link)
      target = posixpath.normpath(posixpath.join(posixpath.dirname(name), unquote(parts.path)))
      if not parts.path:
        target = name
      elif target.startswith("../") or not (outdir / target).exists():
        broken.append((name, link, f"{target} is not in the site"))
        continue
      if (outdir / target).is_dir():
        target = posixpath.join(target, "index.html")
      fragment = unquote(parts.fragment)
      if fragment and target in pages and fragment not in pages[target].ids:
        broken.append((name, link, f"{target} has no anchor #{fragment}"))
  return broken


def check_links(app: Sphinx, exception: Exception | None) -> None:
  if exception is not None or app.builder.format != "html":
    return
  for page, link, why in broken_links(Path(app.outdir)):
    logger.warning("broken internal link %r in %s: %s", link, page, why, type="internal_links")


def setup(app: Sphinx) -> dict:
  app.connect("build-finished", check_links)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
