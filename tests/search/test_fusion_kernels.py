"""HBM traffic of the kernels XLA:GPU fuses (softmax, layer norm, an Adam update), counted
by hand: a kernel reads each outside value once and writes each result used outside once.
"""

import jax
import jax.numpy as jnp

from autopar.search.fusion import fusion_groups, hbm_io, is_row_reduction
from autopar.trace import trace

S = jax.ShapeDtypeStruct


def _hbm_bytes(graph) -> int:
    """Bytes every node of ``graph`` moves to or from HBM under ``hbm_io`` (nodes it does
    not classify move all their operands and results)."""
    io = hbm_io(graph)
    total = 0
    for n in graph.nodes:
        reads, writes = io.get(n.id, ((True,) * len(n.inputs), (True,) * len(n.outputs)))
        for t, r, v in zip(n.in_tensors, reads, n.inputs, strict=True):
            total += t.nbytes if r and v >= 0 else 0
        total += sum(t.nbytes for t, w in zip(n.out_tensors, writes, strict=True) if w)
    return total


def test_softmax_reads_its_input_once_and_writes_its_output_once():
    # Megatron's fused softmax / XLA's Triton softmax: one pass over [64, 128] f32.
    g = trace(lambda x: jax.nn.softmax(x, axis=-1), S((64, 128), jnp.float32))
    assert _hbm_bytes(g) == 2 * 64 * 128 * 4
    assert len(set(fusion_groups(g).values())) == 1


def test_scaled_masked_softmax_of_bf16_scores_is_one_pass():
    # The attention chain: bf16 scores -> f32, scale, causal mask, softmax, -> bf16.
    # Reads the bf16 scores (2 B) and the bool mask (1 B), writes bf16 probs (2 B).
    def f(s, m):
        x = jnp.where(m, s.astype(jnp.float32) / 8.0, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(x, axis=-1).astype(jnp.bfloat16)

    n = 4 * 64 * 128
    g = trace(f, S((4, 64, 128), jnp.bfloat16), S((4, 64, 128), jnp.bool_))
    assert _hbm_bytes(g) == n * (2 + 1 + 2)


def test_softmax_backward_reads_input_and_cotangent_once():
    # dx = y * (dy - sum(dy * y)), y recomputed from x: reads x and dy, writes dx.
    def bwd(x, dy):
        return jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), x)[1](dy)[0]

    g = trace(bwd, S((64, 128), jnp.float32), S((64, 128), jnp.float32))
    assert _hbm_bytes(g) == 3 * 64 * 128 * 4


def test_layer_norm_is_one_pass_over_its_rows():
    def ln(x, gamma, beta):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.var(x, -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta

    g = trace(ln, S((32, 256), jnp.float32), S((256,), jnp.float32), S((256,), jnp.float32))
    # x read and y written once; gamma and beta read once.
    assert _hbm_bytes(g) == 2 * 32 * 256 * 4 + 2 * 256 * 4


def test_adam_update_is_one_pass_over_parameters_and_moments():
    def adam(p, grad, m, v):
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    n = 4096
    g = trace(adam, *[S((n,), jnp.float32)] * 4)
    # Four f32 arrays read, three written: apex's FusedAdam, XLA's multi-output fusion.
    assert _hbm_bytes(g) == 7 * n * 4


def test_a_column_reduction_is_the_root_of_its_kernel():
    # sum over axis 0 cannot share a kernel with the subtraction that reads it: x is read
    # by the reduction and again by the subtraction, the [128] sums written and read.
    g = trace(lambda x: x - jnp.sum(x, axis=0), S((64, 128), jnp.float32))
    assert not any(is_row_reduction(n) for n in g.nodes)
    assert _hbm_bytes(g) == 3 * 64 * 128 * 4 + 2 * 128 * 4


def test_row_reduction_is_only_the_last_dim():
    g = trace(
        lambda x: (jnp.sum(x, axis=-1), jnp.max(x, axis=1), jnp.sum(x, axis=(0, 2))),
        S((4, 8, 16), jnp.float32),
    )
    assert [is_row_reduction(n) for n in g.nodes] == [True, False, False]
