"""The docs' links lead somewhere: every relative link of docs/*.md and the README names a file that exists, and a
heading there when it names one; the settings table the Accelerate API page points to is where it says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
UPSTREAM_TESTS = {"test_ddp_comm_hook.py", "test_distributed_data_loop.py", "test_sft.py"}  # the peers' suites


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


def test_every_relative_link_finds_file_and_heading():
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


def test_accelerate_api_links_to_the_settings_table():
    """It pointed at "the README's settings table", which moved to docs/integrations.md, the page the API table is
    on now."""
    api = _section(ROOT / "docs" / "integrations.md", "every-api-that-special-cases-torch-ddp")
    assert api is not None and "README's settings table" not in api
    links = {link for link in LINK.findall(api) if "how-the-plugin-wraps" in link}
    assert links == {"#how-the-plugin-wraps"}, links
    table = _section(ROOT / "docs" / "integrations.md", "how-the-plugin-wraps")
    assert "| source | honoured | refused (error before training, naming it) |" in table


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", text))


def test_readme_installs_from_clone_with_real_extras():
    """`pip install "ddp_ft[trl]"` (the old README) fails: ddp_ft is not on the registry. The README's install section,
    before the Quickstart, installs from a clone, and every extra it or a docs page names is one pyproject defines."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    install = _section(ROOT / "README.md", "install-into-your-own-environment")
    assert install is not None and readme.index(install) < readme.index("## Quickstart")
    assert 'pip install -c constraints.txt ".[trl]"' in install and "git clone" in install
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for page in PAGES:
        text = page.read_text()
        assert "ddp_ft[" not in text, f"{page.name} installs ddp_ft from the registry"
        for named in re.findall(r'pip install[^\n`]*?"\.\[([a-z,]+)\]"', text):
            assert set(named.split(",")) <= extras, (page.name, named)


def test_readme_describes_own_data_with_real_flags():
    """Your own data was undocumented (columns, instruction, eval split, truncation): the README's first screen
    says each, and every flag it or docs/own_data.md's data and model sections name is one `ddp-ft train --help`
    lists."""
    from ddp_ft.commands.cli import SUBCOMMANDS, launch_parser
    from ddp_ft.training.config import build_parser

    section = _section(ROOT / "README.md", "your-own-model-and-data")
    for said in ("`dialogue`", "`summary`", "--instruction", "5% of the rows", "--max-seq-len", "--chat-template"):
        assert said in section, said
    own_data = (ROOT / "docs" / "own_data.md").read_text().partition("\n## The two entry points")[0]  # the data, model
    parser = build_parser([launch_parser(SUBCOMMANDS["train"])])
    known = {option for action in parser._actions for option in action.option_strings}
    unknown = (_flags(section) | _flags(own_data)) - known
    assert not unknown, unknown


def test_every_test_the_docs_cite_exists():
    """The docs back their claims with tests by name (`test_x.py`, `test_x.py::test_name`, a name cut short with
    `...`, or the file with its folder under tests/: `ddp/test_x.py`): a file named by its basename is found in any
    folder of tests/, and each named file holds the named test, so a claim cannot outlive its test."""
    missing = []
    for page in PAGES:
        cited = re.findall(r"((?:[\w.]+/)*test_\w+\.py)(?:::(test_\w+)(\.\.\.|…)?)?", page.read_text())
        for file, name, cut in cited:
            if file.rpartition("/")[2] in UPSTREAM_TESTS:
                continue
            cited_path = file.rpartition("tests/")[2]  # `tests/test_x.py` cites the basename, as `test_x.py` does
            if "/" in cited_path:
                path = ROOT / "tests" / cited_path
            else:
                path = next(ROOT.joinpath("tests").rglob(cited_path), None)
            if path is None or not path.is_file():
                missing.append(f"{page.name}: {file}")
            elif name and not re.search(f"def {name}" + ("" if cut else r"\b"), path.read_text()):
                missing.append(f"{page.name}: {file}::{name}")
    assert not missing, missing


def test_docs_map_reaches_every_page_from_the_tasks():
    """docs/README.md is the map a newcomer opens first: every page of docs/ is linked from it, and it starts from the
    tasks (own data, own model, own script, several GPUs and nodes, a GPU report, a failed run, the guarantees)."""
    map_page = ROOT / "docs" / "README.md"
    linked = {link.partition("#")[0] for link in LINK.findall(map_page.read_text())}
    pages = {page.name for page in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, pages - linked
    text = map_page.read_text().lower()
    for task in ("own data", "own model", "script", "several nodes", "gpu", "fails", "guaranteed"):
        assert task in text, task
    assert "docs/README.md" in (ROOT / "README.md").read_text()  # the README sends newcomers to the map
