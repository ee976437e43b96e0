"""Gradient accumulation from the user's plain step: split at the gradients, microbatch.

A training step computes gradients (**G**: forward and backward, the loss) and then
applies them (**U**: the optimizer's update of parameters and optimizer state). The
tracer already labels the update's equations (phase ``optimizer``, found by data flow:
work after the last backward equation that depends on it or feeds the new state), so the
step splits there without markers. Running G once per microbatch and U once keeps the
step's result exact when every value G hands over is a **sum or a mean over the batch**:

* the step is traced twice, on the whole batch and on one microbatch (batch inputs'
  leading dim divided by ``m``); both traces must have the same equations (a step whose
  structure depends on its batch size cannot be microbatched);
* a value whose traces differ by a scalar literal scaled by ``m`` (``jnp.mean``'s
  divisor, and its transpose in the backward pass) is a **mean**: microbatch values are
  averaged; one with no such literal in its computation is a **sum**: summed; one whose
  leading dim shrinks by ``m`` (per-example outputs) is concatenated; one that does not
  depend on the batch is taken once;
* a reduction over the batch in the forward pass whose result feeds anything but linear
  work (batch-norm statistics, a loss divided by a count computed from the batch, a max
  over the batch) makes microbatching change the result: :class:`AccumulateError` names
  the equation. So does an update that reads the batch itself, and random bits drawn
  for every example from one key (dropout): a microbatch would draw other bits than its
  slice of the whole batch's (per-example keys passed with the batch are split with it).

Gradients accumulate in float32 whatever their dtype (summing ``m`` bf16 gradients in
bf16 would lose the low bits the full-batch step keeps).

Example:
    >>> acc = plan_accumulation(step, (state, batch), microbatches=4)
    >>> acc.rules.count("mean") > 0, acc.microbatches
    (True, 4)
    >>> run = accumulated_function(acc)
    >>> flat = jax.tree.leaves((state, batch))
    >>> new_state, loss = jax.tree.unflatten(acc.full.out_tree, jax.jit(run)(*flat))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from jax.extend.core import DropVar
from jax.extend.core import Literal as JaxLiteral

from autopar.errors import AccumulateError
from autopar.primitives import RANDOM_BITS
from autopar.trace.evaluate import Hook, IntoBodies, read_var, run_equations
from autopar.trace.graph import Graph

Rule = Literal["mean", "sum", "concat", "once"]

_LINEAR = frozenset(
    {
        "reduce_sum",
        "add",
        "add_any",
        "sub",
        "neg",
        "mul",
        "div",
        "convert_element_type",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "copy",
        "copy_p",
        "dot_general",
        "select_n",
        "pjit",
    }
)
"""Work that keeps a sum over the batch a sum (``mul``/``div``/``dot_general``/``select_n``
only by values that do not depend on the batch)."""

_SCALING = frozenset({"mul", "div", "dot_general", "select_n"})


@dataclass(frozen=True)
class Accumulation:
    """How one step runs as ``microbatches`` gradient computations and one update.

    Attributes:
        microbatches: how many.
        full: the step traced on the whole batch (its update equations run).
        micro: the step traced on one microbatch (its gradient equations run).
        gradient_eqns: equation indices of G (the same in both traces).
        update_eqns: equation indices of U.
        handoff: ``(equation, result)`` of every value G hands to U or to the outputs.
        rules: how each handoff value combines over microbatches.
        batch_inputs: flat input indices split into microbatches (leading dim).
        fn: the step function (its signature names the inputs' roles when G is traced).
    """

    microbatches: int
    full: Graph
    micro: Graph
    gradient_eqns: tuple[int, ...]
    update_eqns: tuple[int, ...]
    handoff: tuple[tuple[int, int], ...]
    rules: tuple[Rule, ...]
    batch_inputs: tuple[int, ...]
    fn: Callable[..., Any] | None = None


def microbatch_args(args: Sequence[Any], batch_inputs: Sequence[int], m: int) -> tuple:
    """``args`` as abstract values with each batch leaf's leading dim divided by ``m``."""
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    out = []
    for i, x in enumerate(leaves):
        # ``jax.typeof``: Python scalars (a ``TrainState``'s step) and typed PRNG keys too.
        aval = jax.typeof(x)
        shape = tuple(aval.shape)
        if i in batch_inputs:
            shape = (shape[0] // m, *shape[1:])
        out.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return tuple(jax.tree_util.tree_unflatten(tree, out))


def plan_accumulation(
    fn: Callable[..., Any], args: Sequence[Any], microbatches: int, *, full: Graph | None = None
) -> Accumulation:
    """Analyse ``fn(*args)`` for running its gradients in ``microbatches`` pieces.

    Raises:
        AccumulateError: no batch input, a batch not divisible by ``microbatches``, a step
            whose equations change with the batch size, an update that reads the batch, or
            a forward reduction over the batch that feeds non-linear work (the message
            names it).
    """
    from autopar.trace import trace

    m = int(microbatches)
    if m < 1:
        raise AccumulateError(f"microbatches={microbatches!r} must be an integer >= 1.")
    full = full if full is not None else trace(fn, *args)
    batch = tuple(gi.index for gi in full.inputs if gi.role == "batch")
    if not batch:
        raise AccumulateError(
            "the step has no batch input to split into microbatches (inputs are found by "
            "role: name the data argument 'batch' or pass it after the state)."
        )
    for i in batch:
        gi = full.inputs[i]
        if not gi.tensor.ndim or gi.tensor.shape[0] % m:
            raise AccumulateError(
                f"batch input {gi.path!r} has shape {gi.tensor.shape}: its leading dim must "
                f"divide into {m} microbatches; pick microbatches dividing the batch."
            )
    micro = trace(fn, *microbatch_args(args, batch, m))
    _same_structure(full, micro)
    update, grads = _split(full)
    producer = {v: (k, j) for k, n in enumerate(full.nodes) for j, v in enumerate(n.outputs)}
    batch_values = {full.inputs[i].value for i in batch}
    depends = _batch_dependent(full, batch_values)
    upd = set(update)
    handoff: dict[tuple[int, int], None] = {}
    for k in update:
        for v in full.nodes[k].inputs:
            if v in batch_values:
                raise AccumulateError(
                    f"the update ({full.nodes[k].primitive} at {full.nodes[k].name_stack!r}) "
                    "reads the batch itself; it cannot run once for several microbatches."
                )
            src = producer.get(v)
            if src is not None and src[0] not in upd:
                handoff[src] = None
    for o in full.outputs:
        src = producer.get(o.value)
        if src is not None and src[0] not in upd:
            handoff[src] = None
    _check_forward_reductions(full, micro, grads, depends)
    _check_random_bits(full, micro, grads)
    counts = _batch_count_nodes(full, micro, grads, m)
    counted = _reads_a_count(full, counts)
    rules = tuple(_rule(full, micro, k, j, m, depends, counted) for k, j in handoff)
    return Accumulation(m, full, micro, grads, update, tuple(handoff), rules, batch, fn)


def _split(graph: Graph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(U, G): the update is the optimizer's equations and everything that reads their
    results (the tracer's phase labels say where the update starts; data flow closes it:
    Adam's step count is labelled optimizer, the bias correction that reads it is not)."""
    made: set[int] = set()
    update, grads = [], []
    for k, n in enumerate(graph.nodes):
        if n.phase == "optimizer" or any(v in made for v in n.inputs):
            update.append(k)
            made.update(n.outputs)
        else:
            grads.append(k)
    return tuple(update), tuple(grads)


def _same_structure(full: Graph, micro: Graph) -> None:
    a = [n.primitive for n in full.nodes]
    b = [n.primitive for n in micro.nodes]
    if a != b:
        first = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        raise AccumulateError(
            "the step's equations change with the batch size (first difference at equation "
            f"{first}: {a[first] if first < len(a) else None!r} vs "
            f"{b[first] if first < len(b) else None!r}); it cannot be microbatched."
        )


def _batch_dependent(graph: Graph, batch_values: set[int]) -> set[int]:
    """Value ids that depend on the batch (top level)."""
    dep = set(batch_values)
    for n in graph.nodes:
        if any(v in dep for v in n.inputs):
            dep.update(n.outputs)
    return dep


def _check_forward_reductions(
    full: Graph, micro: Graph, eqns: Sequence[int], depends: set[int]
) -> None:
    """A forward equation that reduces over the batch (its operands shrink with the
    microbatch, its results do not) must feed only linear work."""
    consumers = full.consumers
    for k in eqns:
        n, mn = full.nodes[k], micro.nodes[k]
        if n.phase != "forward":
            continue
        ins_differ = any(
            a.shape != b.shape for a, b in zip(n.in_tensors, mn.in_tensors, strict=True)
        )
        outs_same = all(
            a.shape == b.shape for a, b in zip(n.out_tensors, mn.out_tensors, strict=True)
        )
        if not (ins_differ and outs_same and n.outputs):
            continue
        where = f"{n.primitive} at {n.name_stack or 'top level'!r} (equation {k})"
        if n.primitive not in ("reduce_sum", "dot_general"):
            raise AccumulateError(
                f"{where} reduces over the batch with {n.primitive}: the step is not a sum or "
                "mean over examples, so microbatching would change it."
            )
        # Everything downstream in the forward pass must stay linear.
        stack = list(n.outputs)
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            for c in consumers.get(v, ()):
                cn = full.nodes[c] if isinstance(c, int) else c
                if cn.phase != "forward":
                    continue
                if cn.primitive not in _LINEAR or (
                    cn.primitive in _SCALING and sum(1 for u in cn.inputs if u in depends) > 1
                ):
                    raise AccumulateError(
                        f"{where} reduces over the batch, and its result feeds "
                        f"{cn.primitive} at {cn.name_stack or 'top level'!r}: statistics over "
                        "the batch (batch norm, a loss divided by a count taken from the "
                        "batch) change when the batch is split into microbatches."
                    )
                stack.extend(cn.outputs)


def _check_random_bits(full: Graph, micro: Graph, eqns: Sequence[int]) -> None:
    """Random bits drawn per example from one key (dropout with the step's key) cannot be
    microbatched: each microbatch would draw its own bits from the same key, not its
    slice of the whole batch's, so the masks (and the step) would change. Bits drawn
    from per-example keys (a batch of keys, split with the batch) are fine."""

    def walk(a: Graph, b: Graph, nodes: Sequence[int]) -> None:
        for k in nodes:
            n, mn = a.nodes[k], b.nodes[k]
            if n.primitive in RANDOM_BITS:
                same_key = all(
                    x.shape == y.shape for x, y in zip(n.in_tensors, mn.in_tensors, strict=True)
                )
                if same_key and any(
                    x.shape != y.shape for x, y in zip(n.out_tensors, mn.out_tensors, strict=True)
                ):
                    raise AccumulateError(
                        f"{n.primitive} at {n.name_stack or 'top level'!r} draws random bits "
                        "for every example from one key (dropout, noise): each microbatch "
                        "would draw different bits than its slice of the whole batch's, so "
                        "microbatching would change the step. Plan it without microbatches "
                        "or pipeline stages, or draw the bits from per-example keys passed "
                        "with the batch."
                    )
            for body, mbody in zip(n.body, mn.body, strict=False):
                if len(body.nodes) == len(mbody.nodes):
                    walk(body, mbody, range(len(body.nodes)))

    walk(full, micro, eqns)


def _literals(graph: Graph, k: int) -> list[float]:
    eqn = graph.jaxpr.jaxpr.eqns[k]
    out = []
    for a in eqn.invars:
        if isinstance(a, JaxLiteral) and np.ndim(a.val) == 0:
            out.append(float(a.val))
    return out


def _batch_count_nodes(full: Graph, micro: Graph, eqns: Sequence[int], m: int) -> set[int]:
    """Equations with a scalar literal that scales with the batch size (a mean's divisor
    ``B`` or its inverse ``1/B``)."""
    out = set()
    for k in eqns:
        a, b = _literals(full, k), _literals(micro, k)
        for x, y in zip(a, b, strict=False):
            if x != y and y and (np.isclose(x, m * y) or np.isclose(x * m, y)):
                out.add(k)
    return out


def _reads_a_count(full: Graph, counts: set[int]) -> set[int]:
    """Equations whose computation holds a batch-count literal: those in ``counts`` and
    every equation downstream of one (one pass in program order)."""
    out: set[int] = set()
    tainted: set[Any] = set()
    for k, n in enumerate(full.nodes):
        if k in counts or any(v in tainted for v in n.inputs):
            out.add(k)
            tainted.update(n.outputs)
    return out


def _rule(
    full: Graph, micro: Graph, k: int, j: int, m: int, depends: set[int], counted: set[int]
) -> Rule:
    t_full, t_micro = full.nodes[k].out_tensors[j], micro.nodes[k].out_tensors[j]
    if t_full.shape != t_micro.shape:
        if (
            t_full.ndim
            and t_full.shape[0] == m * t_micro.shape[0]
            and t_full.shape[1:] == t_micro.shape[1:]
        ):
            return "concat"
        raise AccumulateError(
            f"{full.nodes[k].primitive} at {full.nodes[k].name_stack!r} hands the update a "
            f"value of shape {t_full.shape} that is {t_micro.shape} per microbatch; only sums, "
            "means and per-example (leading-dim) values can be combined."
        )
    if full.nodes[k].outputs[j] not in depends:
        return "once"
    # Does the value's computation hold a batch-count literal?
    return "mean" if k in counted else "sum"


def _once_outside(
    acc: Accumulation, every: bool = False
) -> tuple[frozenset[tuple[int, int]], tuple[int, ...]]:
    """Values G hands the update that do not depend on the batch (rule ``once``), to be
    computed once outside the microbatch loop from the whole step's equations, and those
    equations of G, in order: the typed PRNG keys (a state's key split for the next step,
    which no accumulator can hold), or with ``every`` all of them (a pipeline sums its
    outputs over the microbatches: an integer's mean over them would pass through a
    float, a raw ``uint32`` key's low bits lost)."""
    jaxpr = acc.full.jaxpr.jaxpr
    once = frozenset(
        (k, j)
        for (k, j), rule in zip(acc.handoff, acc.rules, strict=True)
        if rule == "once"
        and (every or jnp.issubdtype(jaxpr.eqns[k].outvars[j].aval.dtype, jax.dtypes.prng_key))
    )
    needed: set[int] = set()
    for k, _ in once:
        needed |= {k} | nx.ancestors(acc.full.dag, k)
    return once, tuple(sorted(needed))


def accumulated_function(
    acc: Accumulation, hook: Hook | None = None, into_bodies: IntoBodies = False
) -> Callable[..., list[Any]]:
    """``run(*flat_args) -> flat outputs``: G over each microbatch (a ``lax.scan``), the
    combined values, then U once; ``hook`` as in :func:`autopar.trace.evaluate_inlined`
    (applied to both, node by node: equation ``k`` is the same in both traces)."""
    m = acc.microbatches
    full_j, micro_j = acc.full.jaxpr, acc.micro.jaxpr
    batch = set(acc.batch_inputs)
    outside_once, once_eqns = _once_outside(acc)

    def outvar(graph_jaxpr: Any, k: int, j: int) -> Any:
        return graph_jaxpr.jaxpr.eqns[k].outvars[j]

    def run(*flat: Any) -> list[Any]:
        if hook is not None and hasattr(hook, "reset"):
            hook.reset()
        outside = dict(zip(full_j.jaxpr.constvars, full_j.consts, strict=True))
        outside.update(zip(full_j.jaxpr.invars, flat, strict=True))
        run_equations(acc.full, outside, once_eqns)
        split = {i: flat[i].reshape((m, flat[i].shape[0] // m, *flat[i].shape[1:])) for i in batch}

        def body(carry: tuple, xs: tuple) -> tuple:
            i, mbs = xs
            if hook is not None and hasattr(hook, "reset"):
                hook.reset()  # nothing a hook keeps may leak out of the loop body
            env: dict[Any, Any] = dict(zip(micro_j.jaxpr.constvars, micro_j.consts, strict=True))
            it = iter(mbs)
            for n, v in enumerate(micro_j.jaxpr.invars):
                env[v] = next(it) if n in batch else flat[n]
            run_equations(acc.micro, env, acc.gradient_eqns, hook=hook, into_bodies=into_bodies)
            new, ys = [], []
            for (k, j), rule, c in zip(acc.handoff, acc.rules, carry, strict=True):
                v = read_var(env, outvar(micro_j, k, j))
                if rule in ("mean", "sum"):
                    new.append(c + v.astype(c.dtype))
                elif (k, j) in outside_once:
                    new.append(c)  # computed outside the loop
                elif rule == "once":
                    new.append(jnp.where(i == 0, v, c))
                else:
                    new.append(c)
                    ys.append(v)
            return tuple(new), tuple(ys)

        init = []
        for (k, j), rule in zip(acc.handoff, acc.rules, strict=True):
            t = acc.micro.nodes[k].out_tensors[j]
            dt = _accumulator_dtype(t.dtype) if rule in ("mean", "sum") else t.dtype
            placeholder = rule == "concat" or (k, j) in outside_once
            init.append(jnp.zeros((), jnp.float32) if placeholder else jnp.zeros(t.shape, dt))
        mbs = tuple(split[i] for i in sorted(batch))
        carry, ys = jax.lax.scan(body, tuple(init), (jnp.arange(m), mbs))
        if hook is not None and hasattr(hook, "reset"):
            hook.reset()
        env = dict(zip(full_j.jaxpr.constvars, full_j.consts, strict=True))
        env.update(zip(full_j.jaxpr.invars, flat, strict=True))
        it = iter(ys)
        for (k, j), rule, c in zip(acc.handoff, acc.rules, carry, strict=True):
            t = acc.full.nodes[k].out_tensors[j]
            if rule == "mean":
                val = (c / m).astype(t.dtype)
            elif rule == "sum":
                val = c.astype(t.dtype)
            elif (k, j) in outside_once:
                val = read_var(outside, outvar(full_j, k, j))
            elif rule == "once":
                val = c
            else:
                y = next(it)
                val = y.reshape(t.shape)
            var = outvar(full_j, k, j)
            if not isinstance(var, DropVar):
                env[var] = val
        run_equations(acc.full, env, acc.update_eqns, hook=hook, into_bodies=into_bodies)
        return [read_var(env, v) for v in full_j.jaxpr.outvars]

    return run


def _accumulator_dtype(dtype: str) -> Any:
    d = np.dtype(dtype) if dtype != "bfloat16" else jnp.bfloat16
    if jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits < 32:
        return jnp.float32
    return d


# ----------------------------------------------------------------------------- pipelines


def gradient_function(
    acc: Accumulation, hook: Hook | None = None, into_bodies: IntoBodies = False
) -> Callable[..., tuple]:
    """G as a function of the step's own arguments (one microbatch): returns the values
    G hands to the update and the outputs, in ``acc.handoff`` order. Tracing it
    (:func:`gradient_graph`) keeps every equation's name stack, so layers are found as
    in the step.

    ``hook`` (and ``into_bodies``) as in :func:`autopar.trace.evaluate_inlined`, on the
    microbatch graph ``acc.micro``: a pipeline plan's activation constraints
    (``autopar.lower.lowering``) become ``sharding_constraint`` equations of G, so they
    land in the stage pieces cut from it.

    Example:
        >>> acc = plan_accumulation(step, (state, batch), microbatches=4)
        >>> micro = microbatch_args((state, batch), acc.batch_inputs, 4)
        >>> len(jax.eval_shape(gradient_function(acc), *micro)) == len(acc.handoff)
        True
    """
    micro_j = acc.micro.jaxpr

    def g(*args: Any) -> tuple:
        if hook is not None and hasattr(hook, "reset"):
            hook.reset()
        flat = jax.tree_util.tree_leaves(args)
        env: dict[Any, Any] = dict(zip(micro_j.jaxpr.constvars, micro_j.consts, strict=True))
        env.update(zip(micro_j.jaxpr.invars, flat, strict=True))
        run_equations(acc.micro, env, acc.gradient_eqns, hook=hook, into_bodies=into_bodies)
        return tuple(read_var(env, micro_j.jaxpr.eqns[k].outvars[j]) for k, j in acc.handoff)

    if acc.fn is not None:
        # The step's parameter names (``state``, ``batch``) tell the tracer the roles.
        functools.update_wrapper(g, acc.fn)
    return g


def gradient_graph(
    acc: Accumulation,
    args: Sequence[Any],
    hook: Hook | None = None,
    into_bodies: IntoBodies = False,
) -> Graph:
    """:func:`gradient_function` traced on one microbatch of ``args`` (the step's
    arguments): the graph a pipeline cuts into stages (with ``hook``'s constraints, if
    given, among its equations)."""
    from autopar.trace.api import graph_from_jaxpr

    g = gradient_function(acc, hook, into_bodies)
    micro = microbatch_args(args, acc.batch_inputs, acc.microbatches)
    closed, out_shape = jax.make_jaxpr(g, return_shape=True)(*micro)
    roles = [gi.role for gi in acc.full.inputs]
    return graph_from_jaxpr(
        closed, out_shape, fn=g, args=tuple(micro), kwargs={}, input_roles=roles
    )


def even_stages(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` layer ranges splitting ``num_layers`` into ``num_stages`` equal
    parts (the first stages take one more when it does not divide).

    Example:
        >>> even_stages(8, 2), even_stages(5, 2)
        (((0, 4), (4, 8)), ((0, 3), (3, 5)))
    """
    if num_stages < 1 or num_layers < num_stages:
        raise AccumulateError(
            f"{num_layers} layers cannot be split into {num_stages} pipeline stages; use at "
            f"most {num_layers} stages."
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def pipelined_function(
    acc: Accumulation,
    args: Sequence[Any],
    stages: Sequence[tuple[int, int]],
    schedule: str,
    mesh: Any,
    virtual_stages: int = 1,
    stage_remat: Sequence[str] = (),
    hook: Hook | None = None,
    into_bodies: IntoBodies = False,
) -> Callable[..., list[Any]]:
    """``run(*flat_args) -> flat outputs``: G pipelined over the mesh's ``pipe`` axis
    (:func:`autopar.lower.pipeline.pipelined_gradients`, stages cut from
    :func:`gradient_graph` at the layer ranges ``stages``, each stage rematerialised as
    ``stage_remat`` says: :func:`autopar.lower.stage_remat.remat_stages`), combined as
    the rules say, then U once on the whole batch. ``hook`` applies to G only (the
    activation constraints of the stages, :func:`gradient_function`); U runs as traced."""
    from autopar.lower.pipeline import cut_stages, pipelined_gradients
    from autopar.lower.stage_remat import remat_stages

    for (k, _), rule in zip(acc.handoff, acc.rules, strict=True):
        if rule == "concat":
            raise AccumulateError(
                f"{acc.full.nodes[k].primitive} at {acc.full.nodes[k].name_stack!r} is a "
                "per-example output; a pipeline returns sums and means only."
            )
    graph = gradient_graph(acc, args, hook, into_bodies)
    cut = cut_stages(graph, stages, batch_inputs=acc.batch_inputs)
    if any(r != "none" for r in stage_remat):
        cut = remat_stages(cut, stage_remat)
    pipe = pipelined_gradients(cut, schedule, acc.microbatches, mesh, virtual_stages)
    m = acc.microbatches
    full_j = acc.full.jaxpr
    outside_once, once_eqns = _once_outside(acc, every=True)

    def run(*flat: Any) -> list[Any]:
        tree = acc.full.in_tree
        args_ = jax.tree_util.tree_unflatten(tree, list(flat))[0] if tree is not None else flat
        sums = jax.tree_util.tree_leaves(pipe(*args_))
        env = dict(zip(full_j.jaxpr.constvars, full_j.consts, strict=True))
        env.update(zip(full_j.jaxpr.invars, flat, strict=True))
        run_equations(acc.full, env, once_eqns)  # values taken once: outside the ticks
        for (k, j), rule, v in zip(acc.handoff, acc.rules, sums, strict=True):
            if (k, j) in outside_once:
                continue
            t = acc.full.nodes[k].out_tensors[j]
            val = v / m if rule == "mean" else v
            var = full_j.jaxpr.eqns[k].outvars[j]
            if not isinstance(var, DropVar):
                env[var] = val.astype(t.dtype)
        run_equations(acc.full, env, acc.update_eqns)
        return [read_var(env, v) for v in full_j.jaxpr.outvars]

    run.cut = cut  # type: ignore[attr-defined]
    return run


__all__ = [
    "AccumulateError",
    "Accumulation",
    "Rule",
    "accumulated_function",
    "even_stages",
    "gradient_function",
    "gradient_graph",
    "microbatch_args",
    "pipelined_function",
    "plan_accumulation",
]
