"""Plans in the words people use: data parallel, FSDP / ZeRO-n, Megatron column / row,
sequence / context parallel, expert parallel, pipeline stages.

The planner describes each op's strategy with short tags (``batch(data)+column(tensor)``,
:func:`autopar.search.to_plan.describe_strategy`); the report reads them out here.

Example:
    >>> strategy_words("batch(data)+column(tensor)")
    'data parallel (batch over data) + Megatron column-parallel over tensor'
    >>> strategy_words("row(tensor)+all-reduce")
    'Megatron row-parallel over tensor, then all-reduce'
    >>> zero_words(3)
    'FSDP / ZeRO-3: parameters, gradients and optimizer state sharded over the data axes'
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from autopar.axes import AXES
from autopar.plan import Plan, Spec, TensorSharding

_TAG = re.compile(r"^([a-z_-]+)(?:\(([^)]*)\))?$")

_TAG_WORDS: Mapping[str, str] = {
    "batch": "data parallel (batch over {ax})",
    "column": "Megatron column-parallel over {ax}",
    "row": "Megatron row-parallel over {ax}",
    "seq": "sequence / context parallel over {ax}",
    "heads": "attention heads split over {ax}",
    "expert": "expert parallel over {ax}",
    "vocab": "vocabulary-parallel embedding over {ax}",
    "hidden": "embedding hidden dim split over {ax}",
    "contract": "contracted dim split over {ax} (partial sums)",
    "rhs": "right-hand operand split over {ax}",
}

LINK_WORDS: Mapping[str, str] = {
    "nvlink": "NVLink",
    "infiniband": "InfiniBand",
    "ici": "ICI",
    "dcn": "DCN",
    "host": "host memory",
    "ethernet": "Ethernet",
}

CLASS_WORDS: Mapping[str, str] = {
    "dp_grad": "gradient reduction (data parallel)",
    "fsdp_gather": "parameter gather (FSDP / ZeRO-3)",
    "pipeline_p2p": "stage-to-stage sends (pipeline)",
    "pipeline_relayout": "relayout between stages (pipeline)",
    "tensor": "activation collectives inside ops",
    "seq": "sequence / context parallel exchange",
    "expert": "token dispatch (expert parallel)",
    "reshard": "relayout between ops",
    "batch_reduce": "loss / metric reduction",
}


def strategy_words(tags: str) -> str:
    """One op's strategy tags (``batch(data)+row(tensor)+all-reduce``) in words."""
    parts: list[str] = []
    after: list[str] = []
    for tag in tags.split("+"):
        tag = tag.strip()
        if not tag:
            continue
        m = _TAG.match(tag)
        if m is None:
            parts.append(tag)
            continue
        word, ax = m.group(1), m.group(2)
        if ax is None:
            if word in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all"):
                after.append(word)
            elif word == "replicated":
                parts.append("replicated (every device computes it whole)")
            else:
                parts.append(word)
            continue
        ax = ax.replace(",", " x ")
        parts.append(_TAG_WORDS.get(word, word + " split over {ax}").format(ax=ax))
    text = " + ".join(parts) or "replicated (every device computes it whole)"
    if after:
        text += ", then " + " and ".join(after)
    return text


def axis_words(axis: str) -> str:
    """What a mesh axis is for (``tensor`` -> ``tensor parallel (Megatron)``)."""
    known = AXES.get(axis)
    if known is None:
        return f"axis {axis}"
    return known.words + (" (Megatron)" if known.splits == "model" else "")


def zero_words(stage: int) -> str:
    """A ZeRO stage in words."""
    return {
        0: "no ZeRO: parameters and optimizer state whole on every data-parallel replica",
        1: "ZeRO-1: optimizer state sharded over the data axes",
        2: "ZeRO-2: optimizer state and gradients sharded over the data axes",
        3: "FSDP / ZeRO-3: parameters, gradients and optimizer state sharded over the data axes",
    }.get(stage, f"ZeRO stage {stage}")


def class_words(where: str) -> str:
    """A collective class (``dp_grad``) in words; unknown classes as they are."""
    return CLASS_WORDS.get(where, where.replace("_", " ") if where else "other")


def entry_axes(entry: object) -> tuple[str, ...]:
    """The mesh axes of one spec entry (``None``, an axis, or a tuple of axes)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)  # type: ignore[arg-type]


def dim_words(record: TensorSharding, dim: int, stacked: bool = False) -> str:
    """How dimension ``dim`` of a parameter is split, in words ("" when it is not).

    ``stacked``: the leaf is a scanned layer stack (its dim 0 counts layers).
    """
    axes = entry_axes(record.spec[dim])
    if not axes:
        return ""
    ndim = len(record.shape)
    words = []
    for a in axes:
        known = AXES.get(a)
        splits = known.splits if known else ""
        if splits == "stages":
            words.append(f"layers by pipeline stage ({a})")
        elif record.role in ("batch", "output", "other") and splits in ("batch", "batch+state"):
            words.append(f"{'batch' if dim == 0 else 'split'}, data parallel ({a})")
        elif splits in ("batch", "batch+state"):
            words.append(f"ZeRO / FSDP shard ({a})")
        elif splits == "model" and "embed" in record.path.lower() and dim == 0:
            words.append(f"vocabulary-parallel ({a})")
        elif splits == "model":
            inner = dim - (1 if stacked else 0)
            width = ndim - (1 if stacked else 0)
            if width >= 2 and dim == ndim - 1:
                words.append(f"Megatron column ({a})")
            elif width >= 2 and inner == width - 2:
                words.append(f"Megatron row ({a})")
            else:
                words.append(f"tensor parallel ({a})")
        elif splits == "experts":
            words.append(f"experts ({a})")
        elif splits == "sequence":
            words.append(f"sequence ({a})")
        else:
            words.append(f"split over {a}")
    return " x ".join(words)


def layout_words(record: TensorSharding, stacked: bool = False) -> str:
    """A leaf's layout in words, dimension by dimension.

    Example:
        >>> layout_words(TensorSharding("w", (512, 2048), "float32", ("data", "tensor"), "param"))
        'dim 0: ZeRO / FSDP shard (data); dim 1: Megatron column (tensor)'
    """
    out = []
    for d in range(len(record.spec)):
        w = dim_words(record, d, stacked)
        if w:
            out.append(f"dim {d}: {w}")
    return "; ".join(out) or "replicated on every device"


def pipeline_words(plan: Plan) -> str:
    """The pipeline in a sentence (``""`` for a plan without one)."""
    pp = plan.pipeline
    if pp is None:
        return ""
    if pp.num_stages <= 1:
        if pp.microbatches > 1:
            return f"one stage, gradient accumulation over {pp.microbatches} microbatches"
        return "one stage"
    text = f"{pp.num_stages} pipeline stages, {schedule_words(pp.schedule)}"
    if pp.chunks > 1:
        text += f" with {pp.chunks} virtual stages per device"
    return text + f", {pp.microbatches} microbatches"


def schedule_words(schedule: str) -> str:
    return {
        "gpipe": "GPipe",
        "1f1b": "1F1B",
        "interleaved-1f1b": "interleaved 1F1B",
        "zero-bubble": "zero-bubble (ZB-H1)",
    }.get(schedule, schedule)


def device_ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3, 6"``."""
    ids = sorted(ids)
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def headline(plan: Plan) -> list[str]:
    """Short phrases for the plan's parallelism, one per used axis plus ZeRO, pipeline
    and remat (the chips at the top of the report)."""
    out = [f"{axis_words(a)} x{n} ({a})" for a, n in plan.mesh.items() if n > 1]
    if not out:
        out.append("single device")
    if plan.zero_stage:
        out.append({1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP / ZeRO-3"}.get(plan.zero_stage, "ZeRO"))
    if plan.remat != "none":
        out.append(f"remat {plan.remat}")
    return out


def param_bytes(record: TensorSharding) -> float:
    """A leaf's bytes (itemsize from the dtype name's trailing bit count; 4 if none)."""
    m = re.search(r"(\d+)$", record.dtype)
    bits = int(m.group(1)) if m else 32
    if record.dtype == "bool":
        bits = 8
    return math.prod(record.shape) * bits / 8


def spec_text(spec: Spec) -> str:
    """``("data", None)`` -> ``P('data', None)`` (as :func:`autopar.report.format_spec`)."""
    from autopar.report.text import format_spec

    return format_spec(spec)
