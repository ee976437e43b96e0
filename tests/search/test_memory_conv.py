"""Peak memory of a convolution train step: the planner's memory model against a hand count,
and the XLA:CPU-only buffers that ``memory_analysis`` adds on top of it.

The step (two 3x3 SAME convolutions, ``N, H, W = 8, 16, 16``, ``C = 8`` -> ``K = 16`` ->
``K`` channels, float32, loss ``sum(conv(relu(conv(x, w1)), w2) ** 2)``, SGD update of the
donated kernels) is small enough to count every buffer by hand.

The planner's model (:mod:`autopar.search.build.memory`) holds, at its peak (the backward
``mul`` that makes the output gradient ``dy = 2 y``): the inputs ``w1, w2, x``, and four
activations of ``N H W K`` floats: the first convolution's output ``a`` (the ReLU's backward
reads it), ``h = relu(a)`` (``w2``'s kernel gradient reads it), the forward's ``2 y`` (the
``jvp`` of ``y ** 2``) and ``dy``, plus the 4-byte loss.

XLA:CPU (jaxlib 0.10.2, measured with ``--xla_dump_to``: buffer assignment and live ranges)
holds three more buffers that XLA:GPU does not make where it keeps NHWC (Hopper and later,
16-bit types from Volta on), so the model counts the layout copies only on a device whose
compiler makes them (``Cluster.compiled_on("cpu")``; see the module docstring of
:mod:`autopar.search.build.memory`):

* ``x`` transposed (``N H W C`` floats) and ``dy`` transposed (``N H W K``), beside the
  originals: the kernel-gradient convolutions have the batch as their contracted dimension,
  not in ``NHWC/HWIO`` form, and ``xla/service/cpu/conv_canonicalization.cc`` (a CPU-only
  pass) copies such operands into canonical layout. XLA:GPU hands these convolutions to
  cuDNN as backward-filter convolutions, which read the operands where they are.
* one copy of the donated kernel ``w2``: ``w2``'s input-gradient convolution reads it and
  is not ordered by data dependence before ``w2``'s in-place update, so copy insertion
  keeps a copy; XLA:CPU runs copy insertion only before scheduling, while XLA:GPU runs
  ``RunPostSchedulingCopyInsertion`` (``xla/service/gpu/gpu_compiler.cc``), which removes
  copies the final schedule makes unnecessary (here the update is ``w2``'s last reader).
  (The reversed ``w2`` the input gradient needs reuses ``w2``'s vacated parameter buffer.)
  The model does not count this copy; under the CPU rule it counts the reversed ``w2``
  instead, the same bytes.

plus 24 bytes: the output tuple's table of three 8-byte pointers.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from autopar.lower import CPU_MEMORY_COMPILER_OPTIONS
from autopar.search.build.memory import canonical_conv_specs
from autopar.search.costs import CostContext
from autopar.search.ilp import build
from autopar.trace import trace
from autopar.verify import compiled_peak_bytes
from cost_models import Cluster
from cost_models.errors import CostModelError

N, H, W, C, K = 8, 16, 16, 8, 16
F32 = 4  # bytes

W1 = 3 * 3 * C * K * F32  # 4,608
W2 = 3 * 3 * K * K * F32  # 9,216
X = N * H * W * C * F32  # 65,536
ACT = N * H * W * K * F32  # 131,072: a, h, 2y, dy
LOSS = F32

# By hand, from the shapes: the model's peak, and what XLA:CPU adds.
MODEL_PEAK = W1 + W2 + X + 4 * ACT + LOSS  # 603,652
CPU_ONLY = X + ACT + W2 + 3 * 8  # x^T, dy^T, the copy of w2, the output tuple: 205,848
# The model under XLA:CPU's rule (``DeviceSpec.compiler``), at the same moment:
# x^T (w1's kernel gradient, from the start), w2 reversed and transposed (w2's input
# gradient, from the start), dy^T (w2's kernel gradient, made with dy).
CPU_LAYOUT_COPIES = X + W2 + ACT  # 205,824
OUTPUT_TUPLE = 3 * 8  # not modelled: the output tuple's table of pointers


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _step(params: dict, x: jax.Array) -> tuple[dict, jax.Array]:
    def loss(p: dict) -> jax.Array:
        return jnp.sum(_conv(jax.nn.relu(_conv(x, p["w1"])), p["w2"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value


@functools.cache
def _args() -> tuple[dict, jax.Array]:
    params = {
        "w1": jnp.full((3, 3, C, K), 0.01, jnp.float32),
        "w2": jnp.full((3, 3, K, K), 0.01, jnp.float32),
    }
    return params, jnp.ones((N, H, W, C), jnp.float32)


@functools.cache
def _model_peak(platform: str = "gpu") -> tuple[float, str, dict[str, float]]:
    graph = trace(_step, *_args())
    cluster = Cluster.preset("dgx-a100-80gb").compiled_on(platform)
    bp = build(graph, CostContext(cluster, {"data": 1}))
    peak, moment, breakdown = bp.peak([0] * len(bp.groups))
    return peak, graph.nodes[moment].primitive, breakdown


def test_model_peak_of_a_conv_step_is_the_hand_count():
    peak, primitive, breakdown = _model_peak()
    assert peak == MODEL_PEAK
    assert primitive == "mul"  # dy = 2 y * 1, the backward pass's first full-size value
    assert breakdown["params"] == W1 + W2
    assert breakdown["inputs"] == X
    assert breakdown["activations"] == 4 * ACT + LOSS


def test_a_peak_read_again_is_the_same_and_its_breakdown_is_the_callers():
    """The solve reads a solution's peak and decode reads it again (memoised per choice):
    the second answer is the hand count too, a caller's edit of a breakdown reaches no
    other caller, and a problem under another bound (``replace``) keeps the same peak."""
    graph = trace(_step, *_args())
    bp = build(graph, CostContext(Cluster.preset("dgx-a100-80gb"), {"data": 1}))
    choice = [0] * len(bp.groups)
    first = bp.peak(choice)
    first[2]["activations"] = -1.0  # the caller's own dict
    again = bp.peak(choice)
    assert again[0] == MODEL_PEAK and again[2]["activations"] == 4 * ACT + LOSS
    assert again[1] == first[1]
    bounded = bp.with_memory_limit(1.0)
    assert bounded.peak(choice)[0] == MODEL_PEAK


@functools.cache
def _compiled() -> tuple[float, str]:
    """XLA's peak (``memory_analysis``, the kernels donated) and final HLO of the step."""
    compiled = (
        jax.jit(_step, donate_argnums=(0,))
        .lower(*_args())
        .compile(compiler_options=dict(CPU_MEMORY_COMPILER_OPTIONS))
    )
    return compiled_peak_bytes(compiled.memory_analysis()), compiled.as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's own buffers")
def test_xla_cpu_adds_its_conv_layout_copies_and_the_kernel_copy():
    total, hlo = _compiled()
    assert total - _model_peak()[0] == CPU_ONLY
    # The mechanisms: one copy of a donated kernel, of w2's shape ...
    kernel_copies = re.findall(r"= (f32\[[\d,]+\])\{[\d,]*\} copy\(%params\S*\)", hlo)
    assert kernel_copies == [f"f32[3,3,{K},{K}]"]
    # ... and the layout transpose of x (the operand of w1's kernel gradient), made from
    # the argument alone.
    assert re.search(r"%transpose\S* = f32\[[\d,]+\]\{[\d,]*\} fusion\(%x[\w.]*\)", hlo)


def test_under_the_cpu_rule_the_model_counts_the_layout_copies_by_hand():
    peak, primitive, breakdown = _model_peak("cpu")
    assert peak == MODEL_PEAK + CPU_LAYOUT_COPIES
    assert primitive == "mul"  # the same moment: dy and its copy are made together
    assert breakdown["layout_copies"] == CPU_LAYOUT_COPIES
    assert breakdown["activations"] == 4 * ACT + LOSS
    # The GPU preset itself keeps NHWC: no layout copies.
    assert "layout_copies" not in _model_peak("gpu")[2]
    assert Cluster.preset("dgx-a100-80gb").device.compiler == "xla:gpu"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's own buffers")
def test_under_the_cpu_rule_the_model_is_xla_cpus_peak_but_the_output_tuple():
    """XLA:CPU's copy of the donated w2 takes the bytes the model gives w2's reversed
    copy (which reuses w2's vacated buffer there): the totals agree."""
    total, _ = _compiled()
    assert total - _model_peak("cpu")[0] == OUTPUT_TUPLE


def test_canonical_conv_specs_name_nhwc_and_hwio_in_dimension_number_order():
    # 1-D and 3-D convolutions: NWC/WIO and NDHWC/DHWIO, derived from the layout names.
    def spec(layout: str, first: str, second: str) -> tuple[int, ...]:
        spatial = [i for i, c in enumerate(layout) if c not in (first, second)]
        return (layout.index(first), layout.index(second), *spatial)

    for lhs, rhs in (("NWC", "WIO"), ("NHWC", "HWIO"), ("NDHWC", "DHWIO")):
        assert canonical_conv_specs(len(lhs)) == (spec(lhs, "N", "C"), spec(rhs, "O", "I"))


def test_compiled_on_refuses_an_unknown_platform():
    with pytest.raises(CostModelError, match="platform"):
        Cluster.preset("dgx-a100-80gb").compiled_on("cuda")
