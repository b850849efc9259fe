"""The docs' links lead somewhere: every relative link of docs/*.md and the README names a file that exists, and a
heading there when it names one; the settings table the Accelerate API page points to is where it says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _section(page: Path, anchor: str) -> str | None:
    """The text under the heading whose anchor is ``anchor``, up to the next heading of its level or above."""
    lines, found = page.read_text().splitlines(), None
    for i, line in enumerate(lines):
        heading = re.match(r"(#+)\s+(.*)", line)
        if heading and found is None and _anchor(heading.group(2)) == anchor:
            found, level = i, len(heading.group(1))
        elif heading and found is not None and len(heading.group(1)) <= level:
            return "\n".join(lines[found:i])
    return "\n".join(lines[found:]) if found is not None else None


def test_every_relative_link_names_an_existing_file_and_heading():
    broken = []
    for page in PAGES:
        for link in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and _section(target, anchor) is None):
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_the_accelerate_api_page_links_to_the_settings_table_where_it_is():
    """It pointed at "the README's settings table", which moved to docs/integrations.md."""
    page = (ROOT / "docs" / "accelerate_api.md").read_text()
    assert "README's settings table" not in page
    links = {link for link in LINK.findall(page) if link.startswith("integrations.md")}
    assert links == {"integrations.md#how-the-plugin-wraps"}, links
    table = _section(ROOT / "docs" / "integrations.md", "how-the-plugin-wraps")
    assert "| source | honoured | refused (error before training, naming it) |" in table
