"""Every link between our documents lands: the file exists and, for `file.md#anchor`, a heading of
that file has that anchor (GitHub's rule: lower case, punctuation dropped, spaces to hyphens)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_the_anchor_rule_is_githubs():
    heading = " Episode hooks — `python -m bench.bench_episode`"
    assert anchor(heading) == "episode-hooks--python--m-benchbench_episode"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_our_documents_land(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{target}: no such heading in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)
