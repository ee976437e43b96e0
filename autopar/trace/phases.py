"""Forward / backward / optimizer phases of the top-level equations.

The rule, in order (measured on JAX 0.10: ``jax.grad`` and ``jax.vjp`` name every equation
they emit, with or without Flax, e.g. ``jvp()`` / ``transpose(jvp())`` for plain JAX and
``jvp(GPT)/h_0/attn`` / ``transpose(jvp(GPT))/h_0/attn`` under Flax linen):

1. A name stack containing ``transpose(`` is **backward**; one containing ``jvp(`` is
   **forward** (the primal computation and the residuals the backward pass will read).
2. Equations with neither transform (code outside any differentiated function, hoisted
   loop constants) are placed by program order, which JAX fixes: the differentiated
   function's forward equations, then all of its transposed equations, then whatever the
   caller does with the gradients.

   * no backward equation anywhere: **forward** (an inference or plain function);
   * before the first backward equation: **forward** (input preparation, dropout keys);
   * between the first and the last backward equation: **backward**;
   * after the last backward equation: **optimizer** if it depends on a backward result or
     feeds a state output (the updated parameters / optimizer state, e.g. Adam's step
     counter), else **forward** (e.g. casting the loss for output).

Loop bodies inherit their loop's phase (see :func:`autopar.trace.build.body_phase`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from jax.extend.core import jaxprs_in_params

from autopar.trace.build import RawEqn
from autopar.trace.graph import Phase


def stack_phase(name_stack: str) -> Phase | None:
    """The phase a name stack alone decides, or ``None``.

    Example:
        >>> stack_phase("transpose(jvp(GPT))/h_0"), stack_phase("jvp()"), stack_phase("")
        ('backward', 'forward', None)
    """
    if "transpose(" in name_stack:
        return "backward"
    if "jvp(" in name_stack:
        return "forward"
    return None


def differentiates_inside(eqn: Any) -> bool:
    """Whether a loop or call equation computes gradients inside its body (a
    ``transpose(`` name stack in it): a step that accumulates gradients with ``lax.scan``
    over microbatches, whose top-level loop carries no transform in its own name.

    Example:
        >>> def step(w, xs):
        ...     def body(acc, x):
        ...         return acc + jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), None
        ...     return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]
        >>> j = jax.make_jaxpr(step)(jnp.ones((2, 2)), jnp.ones((3, 4, 2)))
        >>> [differentiates_inside(e) for e in j.eqns if e.primitive.name == "scan"]
        [True]
    """
    if eqn is None:
        return False
    for sub in jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            if "transpose(" in str(inner.source_info.name_stack) or differentiates_inside(inner):
                return True
    return False


def assign_phases(eqns: Sequence[RawEqn], state_outputs: Collection[int]) -> list[Phase]:
    """One phase per top-level equation (see the module docstring for the rule).

    Args:
        eqns: the top-level equations in program order.
        state_outputs: value ids of outputs that are updated inputs (new parameters,
            optimizer state); may be empty.

    Returns:
        ``phases[k]`` for equation ``k``.
    """
    phases: list[Phase | None] = [stack_phase(e.name_stack) for e in eqns]
    # A loop that computes gradients inside its body (gradient accumulation with
    # ``lax.scan``) is a forward loop whose body holds both phases (``body_phase``); its
    # results are gradients, so what follows it is placed as after a backward pass.
    grad_loops = {
        k for k, e in enumerate(eqns) if phases[k] is None and differentiates_inside(e.eqn)
    }
    for k in grad_loops:
        phases[k] = "forward"
    backward = sorted({k for k, p in enumerate(phases) if p == "backward"} | grad_loops)
    if not backward:
        return [p or "forward" for p in phases]
    first, last = backward[0], backward[-1]

    # Values computed from a backward result (taint flows forward in program order).
    tainted: set[int] = set()
    for k in range(first, len(eqns)):
        e = eqns[k]
        if phases[k] == "backward" or k in grad_loops or any(v in tainted for v in e.inputs):
            tainted.update(e.outputs)
    # Equations that feed a state output (walk backwards).
    needed: set[int] = set(state_outputs)
    feeds_state: set[int] = set()
    for k in range(len(eqns) - 1, last, -1):
        e = eqns[k]
        if any(v in needed for v in e.outputs):
            feeds_state.add(k)
            needed.update(v for v in e.inputs if v >= 0)

    out: list[Phase] = []
    for k, p in enumerate(phases):
        if p is not None:
            out.append(p)
        elif k < first:
            out.append("forward")
        elif k < last:
            out.append("backward")
        elif k in feeds_state or any(v in tainted for v in eqns[k].inputs):
            out.append("optimizer")
        else:
            out.append("forward")
    return out


def backward_tainted(eqns: Sequence[RawEqn], phases: Sequence[Phase]) -> set[int]:
    """Value ids computed (transitively) from a backward equation's result."""
    tainted: set[int] = set()
    for e, p in zip(eqns, phases, strict=True):
        if p == "backward" or any(v in tainted for v in e.inputs):
            tainted.update(e.outputs)
        elif p == "forward" and differentiates_inside(e.eqn):
            tainted.update(e.outputs)  # a gradient accumulation loop's results
    return tainted
