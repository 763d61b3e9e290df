"""The self-contained flamegraph.html of `bistouri record` (bistouri/symbolizer/report.py)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from bistouri.symbolizer import formats
from bistouri.symbolizer.model import (
    KIND_JIT,
    KIND_KERNEL,
    KIND_PYTHON,
    KIND_VDSO,
    Frame,
    Profile,
    Sample,
    SessionMeta,
)
from bistouri.symbolizer.report import flamegraph_html

# URLs that appear in the vendored d3 as XML namespace names and in its banner comment: not references.
NOT_REFERENCES = {
    "http://www.w3.org/1999/xhtml",
    "http://www.w3.org/1999/xlink",
    "http://www.w3.org/2000/svg",
    "http://www.w3.org/2000/xmlns/",
    "http://www.w3.org/XML/1998/namespace",
    "https://d3js.org",
}
TRICKY = "evil</script><script>window.pwned=1</script>"


def _profile() -> Profile:
    frames = [
        Frame("main", "app", "src/main.c", 10),
        Frame("serve", "app", "src/serve.c", 42),
        Frame("parse_header", "app", "src/http.h", 7, inlined=True),
        Frame("entry_SYSCALL_64_after_hwframe", "vmlinux", kind=KIND_KERNEL),
        Frame("do_syscall_64", "vmlinux", kind=KIND_KERNEL),
        Frame("schedule", "vmlinux", kind=KIND_KERNEL),
        Frame("__vdso_clock_gettime", "[vdso]", kind=KIND_VDSO),
        Frame(TRICKY, "app"),
        Frame("décode_µs", "app"),
        Frame("JS:*hotLoop", "[jit]", kind=KIND_JIT),
        Frame("Worker.hot_loop", "[python]", "w.py", 6, kind=KIND_PYTHON),
    ]
    samples = [
        Sample((0, 1, 2), on_cpu=60),
        Sample((0, 1, 3, 4), on_cpu=25, off_cpu=9, off_cpu_ns=45_000_000),
        Sample((0, 1, 3, 4, 5), off_cpu=30, off_cpu_ns=900_000_000),
        Sample((0, 6), on_cpu=10),
        Sample((0, 7), on_cpu=5),
        Sample((0, 8), on_cpu=3),
        Sample((0, 9), on_cpu=2),
        Sample((0, 10), on_cpu=4),
    ]
    meta = SessionMeta(
        "rec-1",
        service="api",
        host="box-7",
        processes={777: "app"},
        start_ns=1_790_000_000_000_000_000,
        duration_ns=5_000_000_000,
        period_ns=10_101_010,
        kernel_release="6.1.0-27-amd64",
        on_cpu=103,
        off_cpu=39,
        off_cpu_ns=945_000_000,
    )
    return Profile(meta, frames, samples)


def _html(title: str = "app (777) on box-7 — µ") -> str:
    p = _profile()
    trees = {v: formats.flamegraph(p, v) for v in formats.VALUES}
    meta = p.meta.to_json()
    meta["command"] = "bistouri record -p 777 -d 5"
    return flamegraph_html(trees, meta, title)


def test_report_references_no_url() -> None:
    html = _html(TRICKY + " ✂ µs")
    assert html.isascii()
    # Markup: no element loads anything (scripts and styles are inline).
    markup = re.sub(r"(<script[^>]*>).*?(</script>)", r"\1\2", html, flags=re.S | re.I)
    markup = re.sub(r"(<style[^>]*>).*?(</style>)", r"\1\2", markup, flags=re.S | re.I)
    assert not re.search(r"""\b(?:src|href|action|srcset)\s*=""", markup, re.I), "an element loads a URL"
    assert "<script>" in markup and "<style>" in markup
    styles = "".join(re.findall(r"<style[^>]*>(.*?)</style>", html, flags=re.S | re.I))
    assert not re.search(r"@import|url\(\s*['\"]?(?!data:)", styles, re.I), "a stylesheet loads a URL"
    urls = set(re.findall(r"(?:https?:)?//[a-zA-Z0-9.-]+\.[a-z]{2,}[^\s\"')]*", html))
    assert {u for u in urls if not u.startswith("//")} <= NOT_REFERENCES
    # Frame names and the title cannot close a script element early or inject markup: an HTML
    # parser sees exactly our scripts, and the embedded JSON gives the names back intact.
    assert "window.pwned=1</script>" not in html
    scripts = _scripts(html)
    assert len(scripts) == 7, [a for a, _ in scripts]
    blocks = {a["id"]: json.loads(d) for a, d in scripts if a.get("type") == "application/json"}
    assert set(blocks) == {"bistouri-trees", "bistouri-meta"}
    assert TRICKY in json.dumps(blocks["bistouri-trees"]["on_cpu"], ensure_ascii=False)
    assert blocks["bistouri-meta"]["extra"] == {"command": "bistouri record -p 777 -d 5"}


def _scripts(html: str) -> list[tuple[dict[str, str], str]]:
    found: list[tuple[dict[str, str], str]] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "script":
                found.append(({k: v or "" for k, v in attrs}, ""))

        def handle_data(self, data):
            if found and self.lasttag == "script":
                found[-1] = (found[-1][0], found[-1][1] + data)

    P().feed(html)
    return found


@pytest.mark.slow
def test_report_renders_offline_from_file(browser, tmp_path: Path, screenshots: Path) -> None:
    path = tmp_path / "flamegraph.html"
    path.write_text(_html(), encoding="utf-8")
    context = browser.new_context(viewport={"width": 1280, "height": 760}, offline=True)
    page = context.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(path.as_uri())
        page.locator('g.frame[name="serve"]').wait_for()
        assert page.title() == "app (777) on box-7 — µ"
        assert page.locator('g.frame[name="décode_µs"]').count() == 1
        assert "box-7" in page.locator("#meta").inner_text()
        assert "bistouri record -p 777 -d 5" in page.locator("#meta").inner_text()
        assert (
            page.locator('g.frame[name="parse_header"]').get_attribute("class").split().count("inlined") == 1
        )
        assert page.locator('g.frame[name="do_syscall_64"]').get_attribute("data-kind") == "kernel"
        # JIT code named by a perf map is its own kind, with its own colour in the legend.
        jit = page.locator('g.frame[name="JS:*hotLoop"]')
        assert jit.get_attribute("data-kind") == "jit"
        assert "JIT" in page.locator(".fg-legend").inner_text()
        fill = jit.locator("rect").evaluate("r => getComputedStyle(r).fill")
        user_fill = page.locator('g.frame[name="serve"] rect').evaluate("r => getComputedStyle(r).fill")
        r, g, b = (int(x) for x in re.findall(r"\d+", fill)[:3])
        assert g > r and g > b and fill != user_fill, fill  # green, unlike the warm user frames
        # A Python function too: its own kind and colour (teal), its file:line in the tooltip.
        py = page.locator('g.frame[name="Worker.hot_loop"]')
        assert py.get_attribute("data-kind") == "python"
        assert "Python" in page.locator(".fg-legend").inner_text()
        py_fill = py.locator("rect").evaluate("r => getComputedStyle(r).fill")
        r, g, b = (int(x) for x in re.findall(r"\d+", py_fill)[:3])
        assert g > r and b > r and py_fill not in (fill, user_fill), py_fill
        py.hover()
        tip = page.locator(".fg-tip")
        tip.wait_for()
        assert "w.py:6" in tip.inner_text() and "PYTHON" in tip.inner_text().upper()
        assert "Worker.hot_loop (w.py:6)" in page.locator(".fg-details").inner_text()
        assert page.evaluate("() => window.pwned") is None
        assert page.locator(f'g.frame[name="{TRICKY}"]').count() == 1
        # Zoom, search and views work without a server.
        page.click('g.frame[name="serve"]')
        page.wait_for_function("() => document.querySelector('.fg-crumbs').textContent.includes('serve')")
        page.fill(".fg-search", "syscall")
        page.wait_for_function("() => document.querySelector('.fg-matches').textContent.includes('%')")
        page.screenshot(path=str(screenshots / "report.png"))
        page.click(".seg-btn[data-view=off_cpu_ns]")
        page.locator('g.frame[name="schedule"]').wait_for()
        assert page.locator('g.frame[name="__vdso_clock_gettime"]').count() == 0
    finally:
        context.close()
    assert not errors, errors
    assert requests and all(u.startswith(("file:", "data:")) for u in requests), requests


HOSTILE_COMM = "<!--<script>"  # 12 characters: a valid process name (comm holds 15)


def _hostile_html() -> str:
    p = _profile()
    p.meta.processes = {777: HOSTILE_COMM}
    p.frames[8] = Frame(HOSTILE_COMM, HOSTILE_COMM)
    trees = {v: formats.flamegraph(p, v) for v in formats.VALUES}
    return flamegraph_html(trees, p.meta.to_json(), f"record of {HOSTILE_COMM}")


def test_report_json_blocks_hold_no_less_than_sign() -> None:
    html = _hostile_html()
    blocks = {a["id"]: d for a, d in _scripts(html) if a.get("type") == "application/json"}
    assert set(blocks) == {"bistouri-trees", "bistouri-meta"}
    for text in blocks.values():
        assert "<" not in text
    assert json.loads(blocks["bistouri-meta"])["processes"] == [{"pid": 777, "comm": HOSTILE_COMM}]


@pytest.mark.slow
def test_report_renders_a_process_named_like_a_comment_opener(browser, tmp_path: Path) -> None:
    """`<!--<script>` inside a JSON block made Chromium skip the block's end tag: a blank page."""
    path = tmp_path / "flamegraph.html"
    path.write_text(_hostile_html(), encoding="utf-8")
    context = browser.new_context(viewport={"width": 1280, "height": 760}, offline=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        page.locator('g.frame[name="serve"]').wait_for(timeout=10_000)
        assert page.locator(f'g.frame[name="{HOSTILE_COMM}"]').count() == 1
        assert HOSTILE_COMM in page.locator("#meta").inner_text()
        assert page.title() == f"record of {HOSTILE_COMM}"
    finally:
        context.close()
    assert not errors, errors


def test_a_report_of_a_stack_deeper_than_json_can_nest_is_written_whole() -> None:
    depth = 1500  # json.dumps gives up near 1000 levels of nesting
    frames = [Frame(f"f{i}", "app") for i in range(depth)]
    p = Profile(SessionMeta("deep"), frames, [Sample(tuple(range(depth)), on_cpu=1)])
    page = flamegraph_html({"on_cpu": formats.flamegraph(p, "on_cpu")}, p.meta.to_json(), "deep")
    block = re.search(r'id="bistouri-trees">(.*?)</script>', page, re.S)
    assert block is not None
    text = block.group(1)  # json.loads nests no deeper than json.dumps: count instead
    assert text.count('"children":[') == depth + 1  # the root and every frame
    assert '"name":"f1499"' in text and text.count("[") == text.count("]") and text.endswith("]}}")
