"""Headless Chromium for the visualizer: DOM dumps and screenshots of a page.

Used by the tests, the visualizer benchmark and docs/make_screenshot.py.
Each run gets a fresh profile directory and flags that keep Chromium off the
network, so a run is hermetic and works as root in a container.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHROMIUM_FLAGS", "Dump", "dump_dom", "find_chromium", "screenshot"]

log = logging.getLogger(__name__)

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars")
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass(frozen=True, slots=True)
class Dump:
    html: str           # the DOM after the page's scripts ran
    seconds: float      # wall time of the whole browser run (start, load, scripts, dump)


def _run(args: list[str], page: Path, timeout: float, chromium: str | None,
         fragment: str = "") -> subprocess.CompletedProcess[str]:
    binary = chromium or find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="hetc-chromium-") as profile:
        command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri() + (f"#{fragment}" if fragment else "")]
        log.info("running %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"chromium exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def dump_dom(page: Path, timeout: float = 120, chromium: str | None = None, budget_ms: int = 10000,
             fragment: str = "") -> Dump:
    """The page's DOM once loaded; `budget_ms` of virtual time lets timers and frames run first.

    `fragment` is the URL's #part (the page's deep links: rank=5&index=17, q=..., compact).
    """
    started = time.perf_counter()
    result = _run(["--dump-dom", f"--virtual-time-budget={budget_ms}"], page, timeout, chromium, fragment)
    return Dump(result.stdout, time.perf_counter() - started)


def screenshot(page: Path, png: Path, size: tuple[int, int] = (1600, 900), timeout: float = 120,
               chromium: str | None = None, fragment: str = "") -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--screenshot={png.resolve()}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=5000"],
         page, timeout, chromium, fragment)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png
