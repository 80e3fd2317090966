"""The documentation: the site builds with every link and anchor checked, and the README
stays a short front page whose links all lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra (scripts/install test)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "SamplingParams" in reference and "EngineConfig" in reference, "the API reference came out empty"


def test_the_readme_is_a_short_front_page_with_working_links():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local, "the README links the documentation pages"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    named = re.findall(r"\b(docs/[\w./-]+\.md)\b", readme)
    assert all((ROOT / n).exists() for n in named), [n for n in named if not (ROOT / n).exists()]
