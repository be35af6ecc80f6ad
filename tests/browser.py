"""Open an HTML file in headless Chromium (Debian's package, driven by playwright) and report what happened.

    python tests/browser.py REPORT.html SCREENSHOT.png [WIDTH HEIGHT]
    python tests/browser.py first_layer_io_all_modes_report.html docs/report.png 1100 900   # docs/report.png

playwright's own browser downloads are never used: the system's /usr/bin/chromium is launched
with everything that would reach the network (updates, sync, background requests) turned off,
and every request that is not a file: or data: URL is recorded and aborted.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def inspect(html: Path, screenshot: Path, width: int = 1280, height: int = 1000) -> dict:
    """Load `html`; returns image sizes, network requests, console errors, page errors and the screenshot bytes."""
    from playwright.sync_api import sync_playwright

    network: list[str] = []
    console_errors: list[str] = []
    page_errors: list[str] = []

    def route(r):
        url = r.request.url
        if url.startswith(("file:", "data:")):
            r.continue_()
        else:
            network.append(url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/*", route)
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("requestfailed", lambda r: None if r.url.startswith(("file:", "data:")) else network.append(r.url))
            page.goto(Path(html).resolve().as_uri(), wait_until="load")
            images = page.evaluate("""() => Array.from(document.images).map(i => ({
                complete: i.complete, width: i.naturalWidth, height: i.naturalHeight, alt: i.alt}))""")
            scroll_width = page.evaluate("() => document.documentElement.scrollWidth")
            scroll_height = page.evaluate("() => document.documentElement.scrollHeight")
            sections = page.evaluate("""() => Object.fromEntries(Array.from(document.querySelectorAll('section')).map(
                s => [s.id, {top: s.getBoundingClientRect().top, height: s.getBoundingClientRect().height}]))""")
            png = page.screenshot(path=str(screenshot), full_page=False)
        finally:
            browser.close()
    return {"images": images, "network": sorted(set(network)), "console_errors": console_errors,
            "page_errors": page_errors, "screenshot": png, "scroll_width": scroll_width,
            "scroll_height": scroll_height, "sections": sections}


if __name__ == "__main__":
    size = [int(x) for x in sys.argv[3:5]] or [1280, 1000]
    result = inspect(Path(sys.argv[1]), Path(sys.argv[2]), *size)
    from PIL import Image  # 256 colours keep the README's screenshot small

    Image.open(sys.argv[2]).convert("RGB").quantize(256).save(sys.argv[2], optimize=True)
    print({k: v for k, v in result.items() if k != "screenshot"}, Path(sys.argv[2]).stat().st_size, "bytes")
