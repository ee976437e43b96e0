"""What differs between two plans: mesh, knobs, per-input layouts, predicted cost.

Example:
    >>> dp = autopar.baselines.data_parallel(graph, {"data": 8})
    >>> print(diff(dp, autopar.baselines.zero(graph, {"data": 8}, stage=3)))
    zero_stage: 0  ->  3
    state/opt_state/0/mu/layer_0/b: P(None)  ->  P('data')
    ...
    state/params/layer_1/w: P(None, None)  ->  P('data', None)
"""

from __future__ import annotations

from autopar.plan import Plan
from autopar.report.text import format_bytes, format_seconds, format_spec, mesh_text


def diff(a: Plan, b: Plan) -> str:
    """A line per difference; ``"plans are identical"`` when there is none."""
    lines: list[str] = []
    if dict(a.mesh) != dict(b.mesh):
        lines.append(f"mesh: {mesh_text(a)}  ->  {mesh_text(b)}")
    for knob in ("zero_stage", "remat", "pipeline"):
        va, vb = getattr(a, knob), getattr(b, knob)
        if va != vb:
            lines.append(f"{knob}: {va}  ->  {vb}")
    bpaths = {r.path: r for r in b.inputs}
    for r in a.inputs:
        other = bpaths.pop(r.path, None)
        if other is None:
            lines.append(f"input only in A: {r.path}")
        elif other.spec != r.spec:
            lines.append(f"{r.path}: {format_spec(r.spec)}  ->  {format_spec(other.spec)}")
    for path in bpaths:
        lines.append(f"input only in B: {path}")
    pa, pb = a.predicted, b.predicted
    if pa.step_time_s != pb.step_time_s:
        lines.append(
            f"predicted step time: {format_seconds(pa.step_time_s)}  ->  "
            f"{format_seconds(pb.step_time_s)}"
        )
    if pa.memory_bytes_per_device != pb.memory_bytes_per_device:
        lines.append(
            f"predicted memory/device: {format_bytes(pa.memory_bytes_per_device)}  ->  "
            f"{format_bytes(pb.memory_bytes_per_device)}"
        )
    return "\n".join(lines) if lines else "plans are identical"
