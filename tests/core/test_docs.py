"""The docs site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict`` and its
generated pages say what the code and the reference data say.

One build per session (about 10 s on an idle 2-core machine; the hooks import autopar,
price the published runs and render the API from docstrings). Expected values come from
the sources themselves, read here independently of the docs hook: the nav from
``mkdocs.yml``, the verbs from ``autopar.cli.build_parser()``, the published rows from
``benchmarks/reference/*.csv``, the axes from ``autopar.axes``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "benchmarks" / "reference"


class _Page(HTMLParser):
    """What the tests read off a built page: element ids, text, and the rows of each
    ``<div class="autopar-published" data-csv=...>`` table."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.text: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.headers: dict[str, list[str]] = {}
        self._csv: str | None = None
        self._div_depth = 0
        self._in_tbody = False
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "div":
            if self._csv is not None:
                self._div_depth += 1
            elif "autopar-published" in (a.get("class") or "").split():
                self._csv, self._div_depth = a["data-csv"], 1
                self.tables[self._csv], self.headers[self._csv] = [], []
        elif self._csv is not None and tag == "tbody":
            self._in_tbody = True
        elif self._csv is not None and self._in_tbody and tag == "tr":
            self.tables[self._csv].append([])
        elif self._csv is not None and (tag == "th" or (self._in_tbody and tag == "td")):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._csv is not None:
            self._div_depth -= 1
            if self._div_depth == 0:
                self._csv = None
        elif tag == "tbody":
            self._in_tbody = False
        elif tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            (self.tables[self._csv][-1] if tag == "td" else self.headers[self._csv]).append(text)
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _built(site: Path, page: str) -> Path:
    """Where mkdocs writes ``page`` (directory URLs: ``a/b.md`` -> ``a/b/index.html``)."""
    stem = page.removesuffix(".md")
    return site / "index.html" if stem == "index" else site / stem / "index.html"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    return out


def _page(site: Path, page: str) -> _Page:
    return _Page(_built(site, page).read_text(encoding="utf-8"))


def test_every_nav_page_is_built(site: Path) -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    assert "cost-model-validation.md" in pages and "api/autopar.md" in pages
    for page in pages:
        assert (ROOT / "docs" / page).is_file(), f"nav names {page}, not in docs/"
        built = _built(site, page)
        assert built.is_file(), f"{page} was not built ({built})"
        assert "<h1" in built.read_text(encoding="utf-8"), f"{page} has no title"


def test_api_page_documents_the_public_entry_points(site: Path) -> None:
    page = _page(site, "api/autopar.md")
    for name in ("autoparallel", "plan", "SearchOptions", "Plan", "trace", "Cluster"):
        anchors = [i for i in page.ids if i.endswith(f".{name}") and i.count(".") >= 1]
        assert anchors, f"no API entry for autopar.{name}"
    # Rendered from the docstrings: SearchOptions' documented attributes are on the page.
    text = " ".join(page.text)
    for attribute in ("memory_limit_bytes", "microbatch_size", "virtual_stages"):
        assert attribute in text


def test_cli_page_lists_every_verb(site: Path) -> None:
    from autopar.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    verbs = list(sub.choices)
    assert {"demo", "plan", "show", "report"} <= set(verbs)
    page = _page(site, "cli.md")
    text = " ".join(page.text)
    for verb in verbs:
        assert f"autopar-{verb}" in page.ids, f"no section for `autopar {verb}`"
        assert f"usage: autopar {verb}" in text, f"no --help for `autopar {verb}`"


def test_published_table_has_one_row_per_reference_row(site: Path) -> None:
    files = sorted(REFERENCE.glob("*.csv"))
    assert {"megatron2021_table1.csv", "megatron2021_table2.csv"} <= {f.name for f in files}
    page = _page(site, "published-runs.md")
    assert set(page.tables) == {f.name for f in files}
    priced = 0
    for path in files:
        with open(path, newline="") as f:
            records = list(csv.DictReader(f))
        rows = page.tables[path.name]
        assert len(rows) == len(records), path.name
        col = {name: i for i, name in enumerate(page.headers[path.name])}
        for record, cells in zip(records, rows, strict=True):
            cell = {name: cells[i] for name, i in col.items()}
            assert cell["GPUs"] == record["gpus"]
            published = float(record["tflops_per_gpu"])
            assert float(cell["published TFLOP/s"]) == published
            if cell["predicted"] == "—":
                assert cell["error"].startswith("not priced: ")
                continue
            priced += 1
            predicted, error = float(cell["predicted"]), float(cell["error"].rstrip("%")) / 100
            # predicted is printed to 0.1 TFLOP/s, the error to 0.1%
            assert error == pytest.approx(predicted / published - 1, abs=0.05 / published + 5e-4)
            t, p, d = (int(x) for x in cell["t / p / d"].split(" / "))
            assert (t, p, t * p * d) == (
                int(record["tensor"]),
                int(record["pipeline"]),
                int(record["gpus"]),
            )
    # Megatron-LM 2021 Tables 1 and 2: all 22 rows price (their layers split over p).
    assert priced >= 22


def test_concepts_page_has_every_mesh_axis(site: Path) -> None:
    from autopar.axes import AXIS_NAMES

    text = " ".join(_page(site, "concepts.md").text)
    for axis in AXIS_NAMES:
        assert axis in text
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert schedule in text


def _python_block(markdown: str, section: str) -> str:
    """The first ```python block after the heading ``section``."""
    rest = markdown[markdown.index(section) :]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start : rest.index("```\n", start)]


def test_quickstart_first_step_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's code, as a reader copies it, runs sharded and prints what the page says:
    three losses equal to single-device JAX's (DESIGN.md: loss to 1e-5 in f32), then the
    plan's summary for the 8 devices (set by the root conftest, as the snippet's own
    XLA_FLAGS line would)."""
    import jax

    code = _python_block((ROOT / "docs" / "quickstart.md").read_text(), "## A first `@autop")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))  # search, do not read a cache
    ns: dict = {"__name__": "quickstart"}
    exec(compile(code, "quickstart.md", "exec"), ns)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("Plan 'autopar': mesh ") and "(8 devices)" in lines[3]

    params = ns["init"](jax.random.key(0))
    state, expected = (params, ns["opt"].init(params)), []
    single = jax.jit(ns["train_step"].fn)  # the undecorated step, on one device
    for _ in range(3):
        state, loss = single(state, ns["batch"])
        expected.append(float(loss))
    assert [float(x) for x in lines[:3]] == pytest.approx(expected, rel=1e-5)


def _hook(name: str):
    """A module of ``docs/hooks/`` (not a package: mkdocs loads them by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["autopar_docs", "griffe_markdown"])
def test_hook_docstring_examples(name: str) -> None:
    import doctest

    result = doctest.testmod(_hook(name))
    assert result.attempted >= 1 and result.failed == 0


def test_unknown_generated_block_fails_the_build() -> None:
    from types import SimpleNamespace

    from mkdocs.exceptions import PluginError

    hook = _hook("autopar_docs")
    page = SimpleNamespace(file=SimpleNamespace(src_path="x.md"))
    # A known inline block is replaced by the code's own names; an unknown one is an error.
    from autopar.options import REMATS

    assert hook.on_page_markdown("Use <!-- autopar:remats -->.", page=page) == (
        "Use " + ", ".join(f"`{r}`" for r in REMATS) + "."
    )
    with pytest.raises(PluginError, match=r"x\.md: unknown block <!-- autopar:nope -->"):
        hook.on_page_markdown("<!-- autopar:nope -->", page=page)
