"""The HTML report (``autopar report plan.json -o plan.html``, the demo's
``autopar-report/index.html``), rendered in headless Chromium.

Two real plans (a data/tensor plan of the conftest MLP, a 1F1B pipeline plan of a 4-layer
GPT on two nodes of four) are written as self-contained pages and loaded from disk in
Chromium (Debian's ``chromium``, driven by Python playwright; no browser is downloaded).
The page must log no error, request nothing over the network, and show every section with
content derived independently of the report code: device cells from the mesh's size,
device coordinates from ``numpy.unravel_index``, link levels from
``cost_models.Cluster.axis_levels``, who holds which block from JAX's own
``NamedSharding.devices_indices_map``, pipeline boxes from the schedule's definition
(stages x microbatches x {F, B}, each F after the previous stage's, each B after the next
stage's), the capacity line from the A100 80GB datasheet (80 GB).
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
from collections import defaultdict
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from autopar.cli import main
from autopar.plan import PipelinePlan, Plan, to_partition_spec
from autopar.report import write_html, write_report
from autopar.report.page import SECTION_IDS
from cost_models import Cluster
from tests.core.test_plan import _plan as _hand_plan

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
A100_80GB_BYTES = 80 * 10**9  # NVIDIA A100 80GB datasheet: 80 GB HBM2e
SVG_NS = 'xmlns="http://www.w3.org/2000/svg"'


# ------------------------------------------------------------------------------ plans


@functools.cache
def _mlp_plan() -> Plan:
    """The conftest's searched MLP plan (shared with the docstring examples)."""
    import conftest

    return conftest._plan()


@functools.cache
def _pipeline_plan() -> Plan:
    """The pipeline baseline (1F1B, 2 stages x 4 microbatches, data parallel inside) for a
    4-layer GPT on two nodes of four A100s, scored by the cost model (quick: no search)."""
    import autopar
    from autopar import baselines
    from tests.search.test_outer import TWO_NODES, _gpt

    step, args = _gpt()
    plan = baselines.pipeline(step, {"pipe": 2, "data": 4}, *args, microbatches=4)
    ev = autopar.evaluate(step, plan, TWO_NODES, *args)
    return replace(plan, predicted=ev.to_predicted(), cluster=TWO_NODES.to_json())


@functools.cache
def _searched_pipeline_plan() -> Plan:
    """A 1F1B pipeline plan searched for the same GPT (with its shortlist; slow)."""
    import autopar
    from autopar import SearchOptions
    from tests.search.test_outer import TWO_NODES, _gpt

    step, args = _gpt()
    opts = SearchOptions(pipeline_stages=2, schedule="1f1b", microbatches=4)
    return autopar.plan(step, *args, cluster=TWO_NODES, options=opts)


PLANS = {
    "mlp": _mlp_plan,
    "pipeline": _pipeline_plan,
    "searched-pipeline": _searched_pipeline_plan,
}


# --------------------------------------------------------------------------- browser


def _install_chromium() -> str | None:
    """Debian's chromium, installed with apt-get when missing and we may; else why not."""
    if os.path.exists(CHROMIUM):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{CHROMIUM} is missing and apt-get cannot run here (not root, or no apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "install", "-y", "-q", "chromium"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium"],
    ):
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            return f"{' '.join(cmd)} timed out"
        if os.path.exists(CHROMIUM):
            return None
    return f"apt-get install chromium did not provide {CHROMIUM}"


@pytest.fixture(scope="session")
def chromium() -> str:
    why = _install_chromium()
    if why:
        pytest.skip(why)
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[dev]')")
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _open(browser, path: str):
    """Load ``path`` with every http(s) request aborted and recorded; returns the page,
    the console errors and page errors, and the aborted requests."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    remote: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def route(r):
        if r.request.url.startswith(("http://", "https://")):
            remote.append(r.request.url)
            r.abort()
        else:
            r.continue_()

    page.route("**/*", route)
    page.goto(f"file://{path}")
    page.wait_for_load_state("load")
    return page, errors, remote


def _expected_blocks(record, mesh, rd, cd):
    """(row, col) -> device ids holding that block of ``record`` along dims ``rd``
    (``None``: one row) and ``cd``, from JAX's NamedSharding on a mesh of the same shape."""
    devices = np.array(jax.devices()[: math.prod(mesh.values())]).reshape(tuple(mesh.values()))
    sharding = NamedSharding(Mesh(devices, tuple(mesh)), to_partition_spec(record.spec))
    position = {d: i for i, d in enumerate(devices.flat)}
    out = defaultdict(set)
    for dev, index in sharding.devices_indices_map(tuple(record.shape)).items():

        def block(dim, index=index):
            if dim is None:
                return 0
            s = index[dim]
            n = record.shape[dim]
            size = (s.stop if s.stop is not None else n) - (s.start or 0)
            return (s.start or 0) // size

        out[(block(rd), block(cd))].add(position[dev])
    return dict(out)


@pytest.mark.parametrize(
    "name",
    ["mlp", "pipeline", pytest.param("searched-pipeline", marks=pytest.mark.slow)],
)
def test_report_renders_in_chromium(name, browser, tmp_path):
    plan = PLANS[name]()
    path = write_html(plan, str(tmp_path / "plan.html"))
    page, errors, remote = _open(browser, path)
    try:
        # No error in the console, nothing fetched from the network.
        assert errors == []
        assert remote == []
        html = open(path, encoding="utf-8").read()
        assert not re.search(r"https?://", html.replace(SVG_NS, ""))
        assert "<script" not in html and "<link" not in html and " src=" not in html

        # Every section, with its heading, in page order.
        ids = page.eval_on_selector_all("main > section[data-section]", "els => els.map(e => e.id)")
        assert ids == list(SECTION_IDS)
        for sid in SECTION_IDS:
            assert page.locator(f"#{sid} h2").is_visible()

        # mesh: one cell per device of the mesh, at its row-major coordinates; the
        # cluster's other devices drawn as idle; each axis on the links the cost model
        # puts it on.
        n = math.prod(plan.mesh.values())
        cells = page.eval_on_selector_all(
            "#mesh svg .device",
            "els => els.map(e => [Number(e.dataset.device), e.dataset.coords])",
        )
        assert len(cells) == n
        for dev, coords in cells:
            c = np.unravel_index(dev, tuple(plan.mesh.values()))
            assert coords == ", ".join(f"{a}={int(v)}" for a, v in zip(plan.mesh, c, strict=True))
        cluster = Cluster.from_json(plan.cluster)
        assert page.locator("#mesh svg .spare").count() == cluster.num_devices - n
        assert page.locator("#mesh svg .node").count() == cluster.num_nodes
        levels = cluster.axis_levels(plan.mesh)
        for a in plan.mesh:
            links = page.get_attribute(f'#mesh .axis-row[data-axis="{a}"]', "data-links")
            assert links.split() == [lv.name for lv in levels[a]]

        # stages: the schedule's boxes, each F after the previous stage's F of the same
        # microbatch, each B after the next stage's B (and the last stage's B after its F).
        pp = plan.pipeline
        stages_text = page.inner_text("#stages")
        if pp is None or pp.num_stages == 1:
            assert "one stage" in stages_text
            assert page.locator("#stages .op").count() == 0
        else:
            p, m = pp.num_stages, pp.microbatches
            assert pp.schedule in ("gpipe", "1f1b") and pp.chunks == 1
            boxes = page.eval_on_selector_all(
                "#stages svg .op",
                """els => els.map(e => { const b = e.getBoundingClientRect();
                   return [e.dataset.op, Number(e.dataset.stage), Number(e.dataset.mb),
                           b.left, b.right]; })""",
            )
            assert len(boxes) == p * m * 2
            at = {(op, s, j): (lo, hi) for op, s, j, lo, hi in boxes}
            assert set(at) == {(op, s, j) for op in "FB" for s in range(p) for j in range(m)}
            for j in range(m):
                for s in range(p - 1):
                    assert at[("F", s, j)][1] <= at[("F", s + 1, j)][0] + 0.5
                    assert at[("B", s + 1, j)][1] <= at[("B", s, j)][0] + 0.5
                assert at[("F", p - 1, j)][1] <= at[("B", p - 1, j)][0] + 0.5
            assert page.locator("#stages tr.stage-row").count() == p

        # strategies: one row per op the plan describes, in words.
        ops = [(op, tags) for ls in plan.layers for op, tags in ls.ops]
        assert page.locator("#strategies tr.op-row").count() == len(ops)
        words = page.inner_text("#strategies")
        for _, tags in ops:
            if "column(" in tags:
                assert "Megatron column-parallel" in words
            if "row(" in tags:
                assert "Megatron row-parallel" in words
            if "batch(" in tags:
                assert "data parallel" in words
        for a, size in plan.mesh.items():
            if a == "pipe" and size > 1:
                assert "layers by pipeline stage (pipe)" in words

        # sharding: each block held by the devices JAX's NamedSharding gives it.
        leaves = page.eval_on_selector_all(
            "#sharding figure.leaf", "els => els.map(e => e.dataset.path)"
        )
        assert 1 <= len(leaves) <= 4
        for leaf_path in leaves:
            record = plan.input(leaf_path)
            blocks = page.eval_on_selector_all(
                f'#sharding figure.leaf[data-path="{leaf_path}"] .block',
                "els => els.map(e => [Number(e.dataset.row), Number(e.dataset.col), e.dataset.devices])",
            )
            from autopar.report.blocks import block_grid

            rd, cd = block_grid(record, plan.mesh).dims
            want = _expected_blocks(record, plan.mesh, rd, cd)
            got = {(r, c): set(map(int, devs.split())) for r, c, devs in blocks}
            assert got == want

        # time: the stacked bar adds up to the step time; compute and bubble as predicted.
        segs = page.eval_on_selector_all(
            "#time svg .seg", "els => els.map(e => [e.dataset.key, Number(e.dataset.seconds)])"
        )
        pred = plan.predicted
        assert sum(s for _, s in segs) == pytest.approx(pred.step_time_s, rel=1e-6)
        assert dict(segs)["compute"] == pytest.approx(pred.compute_s)
        assert dict(segs).get("bubble", 0.0) == pytest.approx(pred.bubble_s)
        kinds = {c.kind for c in pred.collectives}
        assert kinds <= {k for k, _ in segs}

        # memory: the breakdown adds up to the predicted peak; the capacity line sits at
        # the A100's 80 GB, right of the bar by the bar's share of it.
        mem = page.eval_on_selector_all(
            "#memory svg .mem-seg", "els => els.map(e => Number(e.dataset.bytes))"
        )
        assert sum(mem) == pytest.approx(pred.memory_bytes_per_device, rel=1e-6)
        assert float(page.get_attribute("#memory .capacity", "data-bytes")) == A100_80GB_BYTES
        bar = page.locator("#memory svg .mem-seg").first.bounding_box()
        cap = page.locator("#memory .capacity").bounding_box()
        assert cap["x"] > bar["x"]

        # shortlist: every candidate, the chosen one first (a baseline has none).
        rows = page.locator("#shortlist tr.cand")
        if len(plan.shortlist) > 1:
            assert rows.count() == len(plan.shortlist)
            assert "chosen" in (rows.first.get_attribute("class") or "")
            for c in plan.shortlist[1:]:
                assert c.verdict in page.inner_text("#shortlist")
        else:
            assert rows.count() == 0
            assert "no runner-up" in page.inner_text("#shortlist")

        # verify: not run for a plan that was not compiled.
        assert "not run" in page.inner_text("#verify")

        shot = tmp_path / f"{name}.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
    finally:
        page.close()


# ------------------------------------------------------------------------ no browser


def test_cli_report_writes_one_self_contained_file(tmp_path, capsys):
    plan = _hand_plan()  # data=2 x tensor=4, 1F1B over 2 stages x 8 microbatches
    src = tmp_path / "plan.json"
    plan.save(src)
    out = tmp_path / "x.html"
    assert main(["report", str(src), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert sorted(os.listdir(tmp_path)) == ["plan.json", "x.html"]
    html = out.read_text(encoding="utf-8")
    for sid in SECTION_IDS:
        assert f'<section id="{sid}"' in html
    assert "data=2 x tensor=4" in html
    assert "250.00 ms" in html  # predicted step_time_s = 0.25
    assert "Megatron column-parallel over tensor" in html  # the op tagged column(tensor)
    assert "Megatron row-parallel over tensor" in html  # the op tagged row(tensor)
    assert "ZeRO-1" in html  # zero_stage = 1
    # 1F1B, 2 stages x 8 microbatches: 32 boxes, 16 forward and 16 backward.
    assert len(re.findall(r'class="op"', html)) == 2 * 8 * 2
    assert len(re.findall(r'data-op="F"', html)) == len(re.findall(r'data-op="B"', html)) == 16
    # state/params/w (16, 32) over P(None, 'tensor'): 4 column blocks, each on the 2 devices
    # that share a tensor coordinate (row-major over data=2 x tensor=4: d and d + 4).
    for k in range(4):
        assert f'data-row="0" data-col="{k}" data-devices="{k} {k + 4}"' in html
    assert "not run" in html
    # Self-contained: no script, no external resource, no URL but the SVG namespace.
    assert "<script" not in html and "<link" not in html and " src=" not in html
    assert not re.search(r"https?://", html.replace(SVG_NS, ""))
    # Without .html the output is a report directory, as before.
    assert main(["report", str(src), "--out", str(tmp_path / "rep")]) == 0
    assert "index.html" in os.listdir(tmp_path / "rep")


def test_schedules_draw_their_boxes(tmp_path):
    base = _hand_plan()
    cases = {  # (stage ranges, schedule, microbatches, chunks) -> boxes
        "gpipe": ((((0, 6), (6, 12)), "gpipe", 3, 1), 2 * 3 * 2),
        "interleaved": ((((0, 3), (3, 6), (6, 9), (9, 12)), "interleaved-1f1b", 4, 2), 2 * 2 * 4 * 2),
        "zero-bubble": ((((0, 6), (6, 12)), "zero-bubble", 4, 1), 2 * 4 * 3),  # F, B and W
    }  # fmt: skip
    for name, ((stages, schedule, m, v), boxes) in cases.items():
        plan = replace(base, pipeline=PipelinePlan(stages, schedule, m, chunks=v))
        html = open(write_html(plan, str(tmp_path / f"{name}.html")), encoding="utf-8").read()
        assert len(re.findall(r'class="op"', html)) == boxes, name
        assert len(re.findall(r'class="stage-row"', html)) == 2, name
    # Interleaved: stage 0 holds chunks 0 and 2 (layers 0-2 and 6-8).
    assert "chunk 0: layers 0-2; chunk 1: layers 6-8" in open(tmp_path / "interleaved.html").read()
    # No pipeline: one stage.
    html = open(write_html(replace(base, pipeline=None), str(tmp_path / "one.html"))).read()
    assert "one stage" in html and 'class="op"' not in html


def test_verify_section_shows_predicted_against_compiled(tmp_path):
    from autopar.verify.report import MemoryRow, VerifyReport, VerifyRow

    rows = (
        VerifyRow("all-reduce", 24, 1.1 * 2**20, 24, 2**20, ("tensor",), ("tensor",), "ok", 0.8),
        VerifyRow("all-gather", None, None, 2, 2**18, (), ("data",), "unplanned", 0.2),
    )
    memory = MemoryRow(1.5e9, 1.2e9, 1e9, 1e8, 1e8, 0.0)
    report = VerifyReport("autopar", rows, memory)
    html = open(write_html(_hand_plan(), str(tmp_path / "v.html"), verify=report)).read()
    section = html[html.index('<section id="verify"') : html.index('<section id="summary"')]
    assert "not run" not in section
    assert 'data-kind="all-reduce" data-status="ok"' in section
    assert 'data-kind="all-gather" data-status="unplanned"' in section
    assert "+10.0%" in section  # 1.1 MiB predicted against 1 MiB compiled
    assert "+25.0%" in section  # 1.5 GB predicted against 1.2 GB: over the 20 % tolerance
    assert 'data-kind="peak memory" data-status="memory"' in section
    assert 'data-ok="false"' in section  # an unplanned kind and memory out of tolerance


def test_report_directory_is_self_contained(tmp_path):
    from autopar.verify.report import VerifyReport, VerifyRow

    ok = VerifyReport(
        "autopar", (VerifyRow("all-reduce", 1, 8.0, 1, 8.0, ("data",), ("data",)),), None
    )
    index = write_report(
        _hand_plan(), str(tmp_path / "rep"), sections={"Loss check": "ok 1e-7"}, verify=ok
    )
    html = open(index, encoding="utf-8").read()
    assert "ok 1e-7" in html
    assert 'data-ok="true"' in html and "not run" not in html
    assert "<img" not in html  # the plots are inline SVG; the PNGs are for other documents
    assert not re.search(r"https?://", html.replace(SVG_NS, ""))


def test_a_bare_plan_renders_and_names_are_escaped(tmp_path):
    # A hand-made plan with nothing predicted, no cluster, no parameter, an odd axis name,
    # and markup in its name: every section still renders, and says what is missing.
    plan = Plan(mesh={"x": 2}, name="<script>alert(1)</script>")
    html = open(write_html(plan, str(tmp_path / "bare.html")), encoding="utf-8").read()
    assert "<script" not in html and "&lt;script&gt;" in html
    for sid in SECTION_IDS:
        assert f'<section id="{sid}"' in html
    assert len(re.findall(r'class="device"', html)) == 2
    assert "one stage" in html
    assert "lists no parameter" in html
    assert "no runner-up" in html
    assert "not run" in html
    assert "no device capacity" in html
