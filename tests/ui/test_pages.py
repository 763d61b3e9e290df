"""The symbolizer's web UI in a real headless Chromium against the real service and stored sessions."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.ui import data

pytestmark = pytest.mark.slow

HUE = re.compile(r"hsl\((\d+(?:\.\d+)?)")


def _hue(page, selector: str) -> float:
    fill = page.locator(f"{selector} rect").first.get_attribute("fill") or ""
    m = HUE.match(fill)
    assert m, f"{selector}: fill {fill!r} is not hsl()"
    return float(m.group(1))


def _frame(name: str) -> str:
    return f'#flame g.frame[name="{name}"]'


def _wait_share(page, name: str, full: bool) -> None:
    """Wait until the frame spans the whole chart, or no longer does (the zoom transition has ended)."""
    page.wait_for_function(
        """([name, full]) => {
            const frames = [...document.querySelectorAll('#flame g.frame')];
            const g = frames.find((n) => n.getAttribute('name') === name);
            const svg = document.querySelector('#flame svg');
            if (!g || !svg) return false;
            const width = (n) => Number(n.getAttribute('width'));
            const share = width(g.querySelector('rect')) / width(svg);
            return full ? share >= 0.99 : share < 0.98;
        }""",
        arg=[name, full],
    )


def _frame_width(page, name: str) -> float:
    return float(page.locator(_frame(name) + " rect").first.get_attribute("width") or 0)


def _shot(page, path: Path) -> None:
    """A screenshot down to the end of the page's content (no empty viewport below)."""
    bottom = page.evaluate(
        """() => {
            const shown = ['main', '.fg-tip'].map((s) => document.querySelector(s))
                .filter((n) => n && getComputedStyle(n).display !== 'none');
            return Math.ceil(Math.max(...shown.map((n) => n.getBoundingClientRect().bottom)) + 12);
        }"""
    )
    width = page.viewport_size["width"]
    page.screenshot(
        path=str(path), clip={"x": 0, "y": 0, "width": width, "height": min(max(bottom, 200), 2000)}
    )


def _query(page) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query)


def test_sessions_list_filters_and_pick_for_diff(page, symbolizer_url, stored, screenshots: Path) -> None:
    page.goto(symbolizer_url + "/")  # redirects to /ui/
    assert urlsplit(page.url).path == "/ui/"
    rows = page.locator("table.sessions tbody tr")
    rows.first.wait_for()
    for sid in stored.values():
        assert page.locator(f'tr[data-id="{sid}"]').count() == 1
    new = page.locator(f'tr[data-id="{stored["new"]}"]')
    assert "web-03" in new.inner_text()
    assert "burner" in new.inner_text()
    assert "CPU" in new.locator(".res").inner_text()
    assert "46.2%" in new.locator(".psis").inner_text()
    # Newest first.
    ids = [rows.nth(i).get_attribute("data-id") for i in range(rows.count())]
    ours = [i for i in ids if i in stored.values()]
    assert ours == [stored["new"], stored["io"], stored["old"]]
    _shot(page, screenshots / "sessions.png")

    # Filters go into the URL and narrow the list.
    page.fill("#filters input[name=service]", "storage")
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => document.querySelectorAll('table.sessions tbody tr').length === 1")
    assert _query(page)["service"] == ["storage"]
    assert page.locator("table.sessions tbody tr").get_attribute("data-id") == stored["io"]
    assert "service=storage" in (page.locator("#merged-link").get_attribute("href") or "")
    # The URL alone restores the filter.
    page.goto(symbolizer_url + "/ui/?resource=cpu")
    page.locator("table.sessions tbody tr").first.wait_for()
    assert page.locator("#filters select[name=resource]").input_value() == "cpu"
    assert page.locator(f'tr[data-id="{stored["io"]}"]').count() == 0

    # A relative range: only the session of the last 15 minutes; the merged link gets absolute bounds.
    page.goto(symbolizer_url + "/ui/?range=15m")
    page.locator(f'tr[data-id="{stored["new"]}"]').wait_for()
    assert page.locator(f'tr[data-id="{stored["io"]}"]').count() == 0
    assert page.locator("#filters select[name=range]").input_value() == "15m"
    since = parse_qs(urlsplit(page.locator("#merged-link").get_attribute("href") or "").query)["since"]
    assert since[0].isdigit()

    # What the target's cgroup names: the unit under the service, the container as a pill that filters.
    page.goto(symbolizer_url + "/ui/")
    io = page.locator(f'tr[data-id="{stored["io"]}"]')
    io.wait_for()
    assert page.locator(f'tr[data-id="{stored["new"]}"] .unit').inner_text() == "checkout.service"
    # A container's scope is shown with the short id, whole in its title.
    assert io.locator(".unit").inner_text() == f"docker-{data.CONTAINER_ID[:12]}….scope"
    assert io.locator(".unit").get_attribute("title") == f"systemd unit docker-{data.CONTAINER_ID}.scope"
    pill = io.locator("a.container")
    assert pill.inner_text() == f"docker {data.CONTAINER_ID[:12]}"
    assert data.CONTAINER_ID in (pill.get_attribute("title") or "")
    pill.click()
    # Only that container's sessions stay (other UI modules store sessions of it too: count none).
    page.locator(f'tr[data-id="{stored["new"]}"]').wait_for(state="detached")
    io.wait_for()  # the filtered list drawn
    rows = page.locator("table.sessions tbody tr")
    for i in range(rows.count()):
        assert rows.nth(i).locator("a.container").inner_text() == f"docker {data.CONTAINER_ID[:12]}"
    assert _query(page)["container"] == [data.CONTAINER_ID[:12]]
    assert page.locator("#filters input[name=container]").input_value() == data.CONTAINER_ID[:12]
    assert "container=" in (page.locator("#merged-link").get_attribute("href") or "")
    page.fill("#filters input[name=container]", "")
    page.fill("#filters input[name=unit]", "checkout.service")
    page.click("#filters button[type=submit]")
    io.wait_for(state="detached")
    for role in ("old", "new"):
        page.locator(f'tr[data-id="{stored[role]}"]').wait_for()
    for i in range(rows.count()):
        assert rows.nth(i).locator(".unit").inner_text() == "checkout.service"
    page.goto(symbolizer_url + "/ui/?runtime=docker")
    io.wait_for()
    assert page.locator(f'tr[data-id="{stored["new"]}"]').count() == 0
    for i in range(rows.count()):
        assert rows.nth(i).locator("a.container").inner_text().startswith("docker ")
    assert page.locator("#filters select[name=runtime]").input_value() == "docker"

    # Pick two sessions: A is the older one whatever the click order.
    page.goto(symbolizer_url + "/ui/?resource=cpu")
    page.locator("table.sessions tbody tr").first.wait_for()
    assert page.locator("#diff-link").get_attribute("aria-disabled") == "true"
    page.check(f'tr[data-id="{stored["new"]}"] input.pick')
    page.check(f'tr[data-id="{stored["old"]}"] input.pick')
    href = page.locator("#diff-link").get_attribute("href") or ""
    assert parse_qs(urlsplit(href).query) == {"a": [stored["old"]], "b": [stored["new"]]}
    assert page.locator(f'tr[data-id="{stored["old"]}"] .pick-tag').inner_text() == "A"


def test_session_page_zoom_search_views(page, symbolizer_url, stored, screenshots: Path) -> None:
    page.goto(symbolizer_url + "/ui/")
    page.click(f'tr[data-id="{stored["new"]}"] a.session-link')
    page.wait_for_url(re.compile(r"/ui/session\.html\?id="))
    page.locator(_frame("hot_spin")).first.wait_for()

    meta = page.locator("#meta").inner_text()
    for text in ("burner", "web-03", "checkout", "CPU some", "6.1.0-ui-test", "19 Hz", "burner (4242)"):
        assert text in meta, text
    assert page.locator("#meta .psis").inner_text().startswith("10")
    # The data-quality note: how the user stacks were walked.
    assert "97% whole (to the entry), cut short: 3% no frame pointer" in meta, meta
    assert "frames: 90% .eh_frame, 10% frame pointer" in meta, meta
    # (wire v4) CPython samples: named, or why not.
    note = page.evaluate("() => Bistouri.unwindNote({python: {named: 47, version_unknown: 3}})")
    assert note == "Python: 94% named, not: 6% version unknown", note
    # What an older kernel cost (bpf/features.py), said in words.
    note = page.evaluate("() => Bistouri.unwindNote({kernel: {no_bpf_loop: 50, no_task_pt_regs: 50}})")
    assert note == (
        "kernel before 5.17: user and Python stacks walked to a bounded depth · "
        "kernel before 5.15: user registers of threads in the kernel read from its stack"
    ), note
    assert page.locator(".fg-legend .lg-python").is_visible()

    # Kernel frames are drawn in another colour family than user frames, and say so in the legend.
    assert page.locator(_frame("hrtimer_interrupt")).get_attribute("data-kind") == "kernel"
    assert page.locator(_frame("hot_spin")).get_attribute("data-kind") == "user"
    assert 180 <= _hue(page, _frame("hrtimer_interrupt")) <= 230
    assert _hue(page, _frame("hot_spin")) <= 60
    assert page.locator(".fg-legend .lg-kernel").is_visible()

    # Tooltip: file:line from DWARF, value and percentage.
    page.hover(_frame("hot_spin"))
    tip = page.locator(".fg-tip")
    tip.wait_for(state="visible")
    assert re.search(r"burner\.c:\d+", tip.inner_text()), tip.inner_text()
    assert "samples" in tip.inner_text() and "%" in tip.inner_text()
    _shot(page, screenshots / "session-tooltip.png")

    # Click to zoom: the frame fills the width, its siblings go, the breadcrumb follows; reset undoes it.
    chart_width = float(page.locator("#flame svg").get_attribute("width") or 0)
    assert _frame_width(page, "level1") < 0.99 * chart_width
    page.click(_frame("level1"))
    _wait_share(page, "level1", full=True)
    assert "level1" in page.locator(".fg-crumbs").inner_text()
    assert page.locator(_frame("hrtimer_interrupt")).count() == 1  # a callee stays
    assert page.locator(_frame("__x64_sys_clock_gettime")).count() == 0  # a sibling's callee is hidden
    _shot(page, screenshots / "session-zoomed.png")
    page.click(".fg-reset")
    _wait_share(page, "level1", full=False)
    assert page.locator(_frame("__x64_sys_clock_gettime")).count() == 1
    assert page.locator(".fg-crumbs").inner_text().strip() == "all"

    # Search: highlighted frames, a count and a share of the samples, kept in the URL.
    page.fill(".fg-search", "hot_sp")
    page.wait_for_function("() => document.querySelector('.fg-matches').textContent.includes('%')")
    matches = page.locator(".fg-matches").inner_text()
    assert matches.startswith("1 frame"), matches
    m = re.search(r"([\d.]+)%", matches)
    assert m, matches
    share = float(m.group(1))
    assert 50 < share < 100
    assert page.locator(_frame("hot_spin")).get_attribute("class").split().count("match") == 1
    assert "match" not in (page.locator(_frame("level1")).get_attribute("class") or "").split()
    assert _query(page)["q"] == ["hot_sp"]
    _shot(page, screenshots / "session-search.png")
    # The top table ranks functions by self value; a click searches for that function exactly.
    page.fill(".fg-search", "")
    first = page.locator(".fg-top tbody tr").first
    assert first.get_attribute("data-name") == "hot_spin"
    assert "87.0%" in first.inner_text()  # 900 of 1,035 samples
    first.click()
    assert page.locator(".fg-search").input_value() == "^hot_spin$"
    page.wait_for_function("() => document.querySelector('.fg-matches').textContent.startsWith('1 frame')")
    page.fill(".fg-search", "zzz_nothing")
    page.wait_for_function("() => document.querySelector('.fg-matches').textContent === 'no match'")
    page.fill(".fg-search", "")

    # Views: off-CPU shows where the thread blocked; the URL and the folded download follow.
    page.click(".seg-btn[data-view=off_cpu]")
    page.locator(_frame("__schedule")).first.wait_for()
    assert page.locator(_frame("hot_spin")).count() == 0
    assert _query(page)["view"] == ["off_cpu"]
    folded_href = page.locator("#dl-folded").get_attribute("href") or ""
    assert "value=off_cpu" in folded_href
    folded = page.request.get(symbolizer_url + folded_href).text()
    assert "__schedule" in folded and "hot_spin" not in folded
    page.click(".seg-btn[data-view=off_cpu_ns]")
    page.locator(_frame("shrink_node")).first.wait_for()
    page.hover(_frame("shrink_node"))
    assert re.search(r"\d+(\.\d+)? ms", page.locator(".fg-tip").inner_text())
    _shot(page, screenshots / "session-offcpu-time.png")
    pprof = page.request.get(symbolizer_url + (page.locator("#dl-pprof").get_attribute("href") or ""))
    assert pprof.ok and pprof.body()[:2] == b"\x1f\x8b"


def test_io_session_offcpu_first(page, symbolizer_url, stored) -> None:
    """A session without on-CPU majority still opens on its data, and empty views are disabled."""
    page.goto(f"{symbolizer_url}/ui/session.html?id={stored['io']}&view=off_cpu_ns")
    page.locator(_frame("jbd2_log_wait_commit")).first.wait_for()
    assert page.locator("#flame .seg-btn.active").get_attribute("data-view") == "off_cpu_ns"
    assert "I/O" in page.locator("#meta .res").inner_text()
    # Its unit and container, the whole id and the runtime in the title.
    assert page.locator("#meta .v.unit").inner_text() == f"docker-{data.CONTAINER_ID}.scope"
    container = page.locator("#meta .v.container")
    assert container.inner_text() == f"docker {data.CONTAINER_ID[:12]}"
    assert data.CONTAINER_ID in (container.locator("span").get_attribute("title") or "")


def test_diff_page_colours_growth_and_shrink(page, symbolizer_url, stored, screenshots: Path) -> None:
    page.goto(f"{symbolizer_url}/ui/diff.html?a={stored['old']}&b={stored['new']}")
    page.locator(_frame("hot_spin")).first.wait_for()
    assert "burner on web-03" in page.locator("#side-a").inner_text()
    # hot_spin went from 300/~470 to 900/~1000 samples: it grew, red; the timer interrupts shrank, blue.
    assert _hue(page, _frame("hot_spin")) < 15
    assert 200 <= _hue(page, _frame("hrtimer_interrupt")) <= 230
    assert (
        page.locator(".fg-legend .lg-grew").is_visible()
        and page.locator(".fg-legend .lg-shrank").is_visible()
    )
    page.hover(_frame("hot_spin"))
    tip = page.locator(".fg-tip").inner_text()
    assert "Δ" in tip and "+" in tip
    # The biggest change is listed first: hot_spin's own samples grew, the timer interrupt's shrank.
    top = page.locator(".fg-top tbody tr")
    assert top.first.get_attribute("data-name") == "hot_spin"
    assert top.first.locator("td.up").count() == 2
    names = [top.nth(i).get_attribute("data-name") for i in range(top.count())]
    shrank = page.locator('.fg-top tbody tr[data-name="hrtimer_interrupt"] td.down')
    assert "hrtimer_interrupt" in names and shrank.count() == 2
    page.mouse.move(5, 5)
    _shot(page, screenshots / "diff.png")
    # Swap: A and B change places in the URL.
    page.click("#swap")
    page.locator(_frame("hot_spin")).first.wait_for()
    assert _query(page)["a"] == [stored["new"]]
    assert _hue(page, _frame("hot_spin")) >= 200


def test_diff_by_filters_and_merged(page, symbolizer_url, stored, screenshots: Path) -> None:
    page.goto(f"{symbolizer_url}/ui/merged.html?service=checkout")
    page.locator(_frame("hot_spin")).first.wait_for()
    page.wait_for_function("() => /^\\d/.test(document.querySelector('#session-count').textContent)")
    assert int(page.locator("#session-count").inner_text().split()[0]) >= 2
    page.hover(_frame("all"))
    assert "samples" in page.locator(".fg-tip").inner_text()
    page.mouse.move(5, 5)
    _shot(page, screenshots / "merged.png")

    page.goto(f"{symbolizer_url}/ui/diff.html?a.service=checkout&b.service=storage&view=off_cpu")
    page.locator(_frame("__schedule")).first.wait_for()
    assert "service=checkout" in page.locator("#side-a").inner_text()


def test_unknown_session_says_so(browser, symbolizer_url, stored) -> None:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{symbolizer_url}/ui/session.html?id=no-such-session")
        error = page.locator("#meta .error")
        error.wait_for()
        assert "404" in error.inner_text()
        assert page.locator("#flame g.frame").count() == 0
    finally:
        context.close()
