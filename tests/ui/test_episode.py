"""The timeline (flight-recorder samples before the trigger) and manual sessions, in Chromium."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.ui import data

pytestmark = pytest.mark.slow

# The share of the chart's width a frame takes, once the frame is drawn.
SHARE = """(name) => {
    const g = [...document.querySelectorAll('#flame g.frame')].find((n) => n.getAttribute('name') === name);
    const svg = document.querySelector('#flame svg');
    if (!g || !svg) return null;
    return Number(g.querySelector('rect').getAttribute('width')) / Number(svg.getAttribute('width'));
}"""


def _wait_share(page, name: str, expected: float, tol: float = 0.005) -> None:
    """Wait until `name` spans `expected` of the chart: that tree is drawn and its transition is over."""
    try:
        page.wait_for_function(
            f"([name, e, tol]) => {{ const s = ({SHARE})(name);"
            " return s !== null && Math.abs(s - e) <= tol; }",
            arg=[name, expected, tol],
        )
    except Exception as e:
        raise AssertionError(f"{name} spans {page.evaluate(SHARE, name)} of the chart, not {expected}") from e


def _width_pct(page, selector: str, prop: str) -> float:
    style = page.locator(selector).get_attribute("style") or ""
    return float(style.split(prop + ":")[1].rstrip("%;"))


def test_timeline_shows_the_onset_and_its_own_flamegraph(page, symbolizer_url, episodes, screenshots: Path):
    sid = episodes["onset"]
    page.goto(f"{symbolizer_url}/ui/session.html?id={sid}")
    page.locator("#tl-bar").wait_for()

    # 5 s of the 15 s session came before the trigger: a third of the bar, shaded, the trigger at its end.
    third = 100 * data.ONSET_PRE_NS / (data.ONSET_PRE_NS + data.ONSET_POST_NS)
    assert _width_pct(page, "#tl-before", "width") == pytest.approx(third, abs=0.01)
    assert _width_pct(page, "#tl-trigger", "left") == pytest.approx(third, abs=0.01)
    assert "before the trigger · 5 s" in page.locator("#tl-before").inner_text()
    background = page.eval_on_selector("#tl-before", "n => getComputedStyle(n).backgroundImage")
    assert "gradient" in background  # shaded apart from the rest
    # Samples on each side, from the session JSON (60 + 15 before; 400 + 5 after), and their rates.
    before = page.locator("#tl-count-before").inner_text()
    assert "75 on-CPU samples (15/s)" in before and "9 off-CPU waits" in before
    assert "405 on-CPU samples (40.5/s)" in page.locator("#tl-count-after").inner_text()
    assert page.locator("#part-all").get_attribute("aria-selected") == "true"

    # The whole session: reclaim is a small part of it.
    _wait_share(page, "try_to_free_pages", 65 / 480)

    # The onset alone: reclaim is most of it, the view's total says 75.
    page.click("#part-before")
    _wait_share(page, "try_to_free_pages", 60 / 75)
    assert page.locator('#flame .seg-btn[data-view="on_cpu"] .seg-count').inner_text() == "75"
    assert _query(page)["part"] == ["before"]
    folded = page.locator("#dl-folded").get_attribute("href") or ""
    assert parse_qs(urlsplit(folded).query)["part"] == ["before"]
    _shot(page, screenshots / "session-onset.png")
    page.locator("#timeline").screenshot(path=str(screenshots / "session-episode.png"))

    # After the trigger: the spin, reclaim almost gone.
    page.click("#part-after")
    _wait_share(page, "try_to_free_pages", 5 / 405)
    _wait_share(page, "hot_spin", 400 / 405)
    assert page.locator('#flame .seg-btn[data-view="on_cpu"] .seg-count').inner_text() == "405"

    # The onset compared with what followed: reclaim shrank (blue), the spin grew (red).
    page.click("#diff-onset")
    page.wait_for_url(re.compile(r"/ui/diff\.html\?"))
    sides = {"a": sid, "a.part": "before", "b": sid, "b.part": "after"}
    assert {k: v[0] for k, v in _query(page).items()} == sides
    page.locator(_frame("try_to_free_pages")).first.wait_for()
    assert 200 <= _hue(page, _frame("try_to_free_pages")) <= 230
    fill = page.locator(_frame("try_to_free_pages") + " rect").first.get_attribute("fill") or ""
    assert int(fill.split(",")[1].strip(" %")) >= 40, fill  # saturated: a change, not the grey of "unchanged"
    assert _hue(page, _frame("hot_spin")) < 15
    assert "before the trigger" in page.locator("#side-a").inner_text()
    assert "75 on-CPU samples" in page.locator("#side-a").inner_text()
    assert "405 on-CPU samples" in page.locator("#side-b").inner_text()

    # The URL alone restores the part.
    page.goto(f"{symbolizer_url}/ui/session.html?id={sid}&part=before")
    _wait_share(page, "try_to_free_pages", 60 / 75)
    assert page.locator("#part-before").get_attribute("aria-selected") == "true"


def test_manual_badge_and_kind_filter(page, symbolizer_url, episodes, stored) -> None:
    page.goto(symbolizer_url + "/ui/")
    manual = page.locator(f'tr[data-id="{episodes["manual"]}"]')
    manual.wait_for()
    assert manual.locator(".badge-manual").inner_text() == "manual"
    assert page.locator(f'tr[data-id="{episodes["onset"]}"] .badge-manual').count() == 0
    assert page.locator(f'tr[data-id="{episodes["onset"]}"] .onset').inner_text() == "5 s before"
    assert manual.locator(".onset").count() == 0
    assert page.locator(f'tr[data-id="{stored["new"]}"] .badge-manual').count() == 0

    # The list filtered by trigger kind, from the form, kept in the URL.
    page.select_option("#filters select[name=kind]", "manual")
    page.click("#filters button[type=submit]")
    page.wait_for_function(
        "() => [...document.querySelectorAll('table.sessions tbody tr')]"
        ".every((r) => r.querySelector('.badge-manual'))"
    )
    assert _query(page)["kind"] == ["manual"]
    assert manual.count() == 1
    assert page.locator(f'tr[data-id="{episodes["onset"]}"]').count() == 0
    page.goto(symbolizer_url + "/ui/?kind=psi")
    page.locator(f'tr[data-id="{episodes["onset"]}"]').wait_for()
    assert page.locator(".badge-manual").count() == 0

    # The session page says it too; with no flight recorder, nothing comes before the capture.
    page.goto(f"{symbolizer_url}/ui/session.html?id={episodes['manual']}")
    page.locator("#tl-bar").wait_for()
    assert page.locator("#meta .badge-manual").inner_text() == "manual"
    assert "manual (capture now) · CPU" in page.locator("#meta").inner_text()
    assert page.locator("#tl-before").count() == 0
    assert page.locator("#part-before").is_disabled()
    assert "capture now" in page.locator("#tl-trigger").inner_text()


def _frame(name: str) -> str:
    return f'#flame g.frame[name="{name}"]'


def _hue(page, selector: str) -> float:
    fill = page.locator(f"{selector} rect").first.get_attribute("fill") or ""
    m = re.match(r"hsl\((\d+(?:\.\d+)?)", fill)
    assert m, f"{selector}: fill {fill!r} is not hsl()"
    return float(m.group(1))


def _query(page) -> dict[str, list[str]]:
    return parse_qs(urlsplit(page.url).query)


def _shot(page, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
