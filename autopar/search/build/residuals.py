"""Build stage 4, memory (part): what the forward pass keeps for the backward pass.

The residuals of a training step are the values its forward pass produces and its backward
pass reads. :func:`residuals` finds them in the traced :class:`Graph` (scan bodies
included) and decides which of them are *stored* under a remat policy and which are
*rebuilt* in the backward pass; :func:`autopar.search.build.memory.liveness` applies that
decision to the planner's live-value timeline (``remat="selective"`` / ``"full"``: a
rebuilt value is not live from the forward into the backward, only around its recompute),
so ``BuiltProblem.peak`` and the ILP's memory constraints reflect the policy. It also
charges the stored bytes to the layers of ``graph.layers`` (:attr:`Residuals.layer_bytes`).

What is stored is a minimum cut (the formulation of Chen et al.'s checkpointing and of
PyTorch's min-cut rematerialisation partitioner): every forward value is either stored
(costing its bytes times the trip counts of the loops around it) or recomputed in the
backward pass from stored values, and the cut minimises the stored bytes under three rules.

* **Recomputable ops** (``recompute_elementwise=True``): elementwise, broadcast and layout
  ops (``autopar.primitives.RECOMPUTABLE``) may be recomputed inside fused backward
  kernels, as Megatron's hand-written kernels (fused bias-GeLU, fused softmax, LayerNorm)
  do (XLA does not; see the measurements below). Matmuls, reductions, gathers, random bits
  and loops may not: their outputs are stored when needed. With
  ``recompute_elementwise=False`` nothing is recomputed: the stored set is exactly the
  values the linearised jaxpr reads, JAX's own residuals.
* **Materialised operands**: a value read by a backward matmul (``dW = x^T dy`` reads
  ``x``; ``dV = P^T dO`` reads ``P``) must sit in memory: it is stored, not recomputed.
* **Free values** cost nothing: graph inputs (parameters, the batch), closed-over
  constants, values computed from literals alone (an ``iota`` causal mask broadcast to
  ``[b, a, s, s]``, counted nowhere rather than once per layer), and values computed from
  parameters / optimizer state alone without random bits (compute-dtype copies of
  weights: parameter memory, not activations). Random bits make activations even when
  their key comes from a step counter (dropout masks).

Remat policies, applied on the graph:

* ``"none"``: the cut above. (The planner's timeline does not use it: under ``"none"``
  it keeps what XLA keeps, the values its fusion materialises; see below.)
* ``"selective"`` (Korthikanti et al. 2022, section 4.2): the **attention core** is never
  stored but recomputed (its matmul and random bits included). Structural rule: an
  *attention matmul* is a forward ``dot_general`` whose two operands both carry batch
  data or random bits (neither is a weight). Its core is its output; every value on a
  path from that output, through non-matmul ops, to an operand of another attention
  matmul (scores, masked and scaled scores, softmax statistics and probabilities,
  dropped-out probabilities); and the values of the output's element count that feed
  those paths (the dropout mask and its random bits). So ``Q K^T`` opens a core and
  ``P V`` closes it; ``P V`` opens none (its output feeds a weight matmul). Copies of a
  core value across a loop boundary are core.
* ``"full"``: every layer is checkpointed. Values produced in a layer and read only by
  that layer's forward are never stored (recomputed from the layer's inputs); values
  crossing into or out of a layer, and loop bodies' inputs, are not recomputed across the
  boundary (stored when needed). For a transformer that leaves each layer's residual
  stream input, ``2 s b h`` bytes in 16 bits.

Scans: a forward ``scan`` body is spliced in once, its values counted ``length`` times;
its stacked outputs (``ys``, which the backward scan reads) are the same bytes as the
per-iteration body values and are stored once; a loop constant counts once.

Attribution: a stored value inside the body of a scan over layers is charged equally to
that scan's layers; a top-level value to the layer all its forward readers belong to (a
layer's input belongs to it), else to its producer's layer, else to no layer
(``outside_bytes``: embedding, final LayerNorm, logits, loss).

Measured on the model zoo's GPT (``benchmarks/models/gpt.py``: pre-LN, bf16 compute, fp32
LayerNorm statistics and softmax, dropout 0.1, tanh GeLU; ``s = h = 256``, ``a = 8``,
``b = 2``; scanned and unrolled layers give identical numbers), per layer, against
Korthikanti's Table 2 (``s b h (34 + 5 a s / h)``, ``34 s b h``, ``2 s b h``;
``tests/search/test_residuals.py``):

* ``"none"``: 1.004x. The cut stores Megatron's set (up to ties of equal bytes, below):
  both LayerNorms' inputs and outputs (8 sbh), Q, K, V (6), the bf16 scores, dropout
  mask and dropped-out probabilities (5 a s^2 b), the output projection's input (2),
  fc_in's output and the GeLU output (16), two residual dropout masks (2); plus fp32
  LayerNorm / softmax statistics, ``8 b s (a + 2)`` bytes (0.4%). The fp32 softmax and
  LayerNorm internals cost nothing: they are recomputed from the bf16 values.
* ``recompute_elementwise=False`` (JAX's literal residuals): 1.92x. JAX keeps the fp32
  softmax numerator (4 a s^2 b), the bf16 dropped-out probabilities (2) and the mask (1):
  7 a s^2 b instead of 5; per LayerNorm the fp32 ``x - mean`` and two fp32 products
  (12 sbh) and the bf16 output (2), 14 instead of 4; for the tanh GeLU its input, three
  products, ``tanh`` and ``1 - tanh^2`` (48 sbh) instead of 16: 86 sbh + 7 a s^2 b in all.
  XLA keeps these: the CPU-compiled fp32 gradient with scanned layers grows by 218.4 sbh
  of temp memory per layer, as predicted here (218.4), and by 164.2 (164.2) at s = 128,
  h = 512. (With unrolled layers XLA's scheduler sometimes keeps less: 216.1 against
  218.4 at s = h = 256 but 64.1 against 164.2 at s = 128, h = 512; not investigated.)
  The planner's ``"none"`` timeline grows by the same 1.92x per scanned layer (the
  forward scan's stacked outputs are JAX's residuals, plus the two LayerNorm scales in
  fp32) and by 1.73x per unrolled layer (XLA's fusion recomputes cheap elementwise
  producers inside backward fusions; it keeps dropout's uint32 bits, not the mask).
* ``"selective"``: 1.002x of ``34 s b h``; ``"full"``: exactly ``2 s b h``; the
  planner's timeline under these policies grows by the same bytes per layer.
* fp32: ``s b h (66 + 9 a s / h)``, 1.87x the mixed-precision bytes.

Ties: cuts of equal bytes are broken toward values the backward reads directly; a layer's
residual stream may still be stored as the value entering it or as the branch outputs
that sum to it (same bytes, possibly charged to the neighbouring layer or to
``outside_bytes``: the first and last layer can trade ``2 s b h`` with the outside).
Parameters are told apart by the tracer's input roles (a step that updates them); in a
bare ``jax.grad`` function they may look like batch data and count as activations.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from autopar.trace import trace
    >>> def loss(w, x):
    ...     return jnp.sum(jnp.tanh(x @ w) @ w.T)
    >>> def sgd_step(w, x):
    ...     return w - 0.1 * jax.grad(loss)(w, x)
    >>> f = jax.ShapeDtypeStruct
    >>> g = trace(sgd_step, f((8, 8), jnp.float32), f((4, 8), jnp.float32))
    >>> residuals(g).total_bytes     # tanh output, read by dW: 4 * 8 float32
    128
    >>> residuals(g, recompute_elementwise=False).total_bytes  # and 1 - tanh^2
    256
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from autopar.errors import AutoparError, InvalidOptionError
from autopar.primitives import RANDOM_BITS, RECOMPUTABLE, RECOMPUTE_CONSUMERS
from autopar.search.build.records import Scope
from autopar.trace.graph import Graph, Node, TensorInfo

Remat = Literal["none", "selective", "full"]
REMAT_POLICIES: tuple[str, ...] = get_args(Remat)

# From the primitives table (autopar.primitives): RECOMPUTABLE, ops a fused backward kernel
# may recompute from their operands (Megatron's fused bias-GeLU, softmax and LayerNorm
# kernels do it by hand; XLA does not across the forward/backward boundary, see the module
# docstring); RECOMPUTE_CONSUMERS, the backward consumers that fuse such recomputation (any
# other consumer, e.g. dot_general, sort or while, needs its operand in memory);
# RANDOM_BITS, ops whose outputs are fresh random bits (values computed from them are
# activations even when no batch input reaches them: a dropout mask drawn from a
# step-counter seed).

_DATA_ROLES: frozenset[str] = frozenset({"batch", "other"})
# Integer capacities: bytes x _SCALE + a tie-break below _SCALE, so that among cuts of
# equal bytes the one storing values the backward reads directly wins (a layer's own
# residuals rather than an equivalent value of the previous layer).
_SCALE = 2


Key = tuple[Scope, int]
"""A value of the step: ``(scope, value id)``, the scope ``()`` at top level (the
``Node.scope`` convention: ``(scan node id, body index)`` of every loop around it)."""


@dataclass(frozen=True)
class SavedValue:
    """One value the forward pass stores for the backward pass.

    Attributes:
        scope: where the value lives: ``()`` at top level, else the ``(node_id,
            body_index)`` path of the loop bodies around it (``Node.scope`` convention).
        value: its value id in that graph (``graph.values`` or the body's).
        tensor: shape and dtype of one instance.
        copies: how many instances are stored (product of the enclosing scans' lengths).
        primitive: the primitive that produced it (looked through loop boundaries).
        name_stack: the producing node's name stack.
        layers: indices into ``Graph.layers`` it is charged to (split evenly); ``()``
            outside every layer.
        aliases: every value holding these same bytes (a scan's stacked output and its
            per-iteration body value), this one included.
    """

    scope: Scope
    value: int
    tensor: TensorInfo
    copies: int
    primitive: str
    name_stack: str
    layers: tuple[int, ...]
    aliases: tuple[Key, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes * self.copies


@dataclass(frozen=True)
class Residuals:
    """What a training step keeps between its forward and backward pass, and where it goes.

    Attributes:
        remat: the remat policy applied (``"none"``, ``"selective"``, ``"full"``).
        recompute_elementwise: whether elementwise values were recomputed in the backward
            pass (``False``: JAX's literal residuals).
        total_bytes: all stored bytes (``sum(layer_bytes) + outside_bytes``).
        layer_bytes: bytes charged to each layer, aligned with ``Graph.layers``.
        outside_bytes: bytes charged to no layer (embedding, head, loss).
        by_primitive: stored bytes by producing primitive.
        by_dtype: stored bytes by dtype.
        saved: the stored values, largest first.
        stored: every value kept from the forward for the backward (all aliases of
            ``saved``).
        computed: the values the forward pass computes (results of its operations, loop
            outputs and bodies included; not the step's inputs or constants).
        sources: per top-level computed value that is not stored (the backward pass
            rebuilds it if it reads it), the stored values it is recomputed from.

    Example:
        >>> res = residuals(graph, remat="full")              # doctest: +SKIP
        >>> res.layer_bytes[0] == 2 * s * b * h               # doctest: +SKIP
        True
    """

    remat: Remat
    recompute_elementwise: bool
    total_bytes: int
    layer_bytes: tuple[int, ...]
    outside_bytes: int
    by_primitive: dict[str, int] = field(default_factory=dict)
    by_dtype: dict[str, int] = field(default_factory=dict)
    saved: tuple[SavedValue, ...] = ()
    stored: frozenset[Key] = frozenset()
    computed: frozenset[Key] = frozenset()
    sources: Mapping[Key, frozenset[Key]] = field(default_factory=dict)

    @property
    def max_layer_bytes(self) -> int:
        """The largest layer's bytes (0 without layers)."""
        return max(self.layer_bytes, default=0)

    def rebuilt(self, key: Key) -> bool:
        """Whether the forward value ``key`` is computed and not stored: under the policy
        it lives in the forward pass only while the forward reads it, and in the backward
        pass only around its recompute (from stored values, or from parameters alone: a
        compute-dtype copy of a weight)."""
        return key in self.computed and key not in self.stored


# ----------------------------------------------------------------------------- the program


@dataclass
class _Op:
    """One forward operation of the unified program (loop bodies spliced in)."""

    primitive: str
    inputs: list[int]
    outputs: list[int]
    home: tuple[int, ...] | None  # layers it belongs to
    alias: bool = False  # a loop boundary: the output is the input, or a slice of it
    same: bool = False  # an alias whose two sides hold the same bytes (stacked <-> slices)


@dataclass
class _Value:
    scope: Scope
    vid: int
    tensor: TensorInfo
    copies: int
    name_stack: str = ""
    producers: list[_Op] = field(default_factory=list)
    consumers: list[_Op] = field(default_factory=list)
    free: bool = False  # a graph input or closed-over constant
    body_input: bool = False  # a loop body's input (a layer boundary under "full")
    needed: bool = False  # read by a backward node
    materialised: bool = False  # read by a backward node that cannot fuse it


class _Program:
    """The forward pass as one dataflow graph over (scope, value id) keys, loop bodies
    spliced in once with their trip count as ``copies``, plus the backward reads."""

    def __init__(self, graph: Graph) -> None:
        self.values: list[_Value] = []
        self.ops: list[_Op] = []
        self.index: dict[Key, int] = {}
        scan_layers: dict[int, list[int]] = defaultdict(list)
        for layer in graph.layers:
            if layer.kind == "scan":
                for nid in layer.nodes:
                    if graph.nodes[nid].primitive == "scan":
                        scan_layers[nid].append(layer.index)
        self.scan_layers = {k: tuple(v) for k, v in scan_layers.items()}
        self.data: set[int] = set()
        for i in graph.inputs:
            k = self._define(graph, i.value, 1, free=True)
            if i.role in _DATA_ROLES:
                self.data.add(k)
        for c in graph.consts:
            self._define(graph, c, 1, free=True)
        self._walk(graph, copies=1, group=None)

    # -- construction -------------------------------------------------------------------
    def _define(self, graph: Graph, vid: int, copies: int, **flags: bool) -> int:
        key = (graph.scope, vid)
        k = self.index.get(key)
        if k is None:
            k = self.index[key] = len(self.values)
            self.values.append(_Value(graph.scope, vid, graph.values[vid], copies, **flags))
        return k

    def _key(self, graph: Graph, vid: int) -> int | None:
        return None if vid < 0 else self.index.get((graph.scope, vid))

    def _add(self, op: _Op) -> None:
        self.ops.append(op)
        for k in op.inputs:
            self.values[k].consumers.append(op)
        for k in op.outputs:
            self.values[k].producers.append(op)

    def _walk(self, graph: Graph, copies: int, group: tuple[int, ...] | None) -> None:
        top = not graph.scope
        for node in graph:
            if node.phase == "forward" or (node.phase != "backward" and node.body):
                home = group if not top else self._node_home(node)
                if node.primitive == "scan" and node.body:
                    self._splice_scan(graph, node, copies, home)
                    continue
                if node.phase != "forward":
                    continue
                ins = [k for k in (self._key(graph, v) for v in node.inputs) if k is not None]
                outs = [self._define(graph, v, copies) for v in node.outputs]
                for k in outs:
                    self.values[k].name_stack = node.name_stack
                self._add(_Op(node.primitive, ins, outs, home))
            elif node.phase == "backward":
                for j, v in enumerate(node.inputs):
                    k = self._key(graph, v)
                    if k is None:
                        continue
                    used, materialised = _backward_use(node, j)
                    self.values[k].needed |= used
                    self.values[k].materialised |= materialised

    def _node_home(self, node: Node) -> tuple[int, ...] | None:
        if node.id in self.scan_layers:
            return self.scan_layers[node.id]
        return None if node.layer is None else (node.layer,)

    def _splice_scan(
        self, graph: Graph, node: Node, copies: int, home: tuple[int, ...] | None
    ) -> None:
        body = node.body[0]
        nc, nk = int(node.params["num_consts"]), int(node.params["num_carry"])
        # A loop that runs forward and backward in one body (gradient accumulation) keeps
        # one iteration's residuals at a time; a forward loop keeps all of them.
        mixed = any(n.phase == "backward" for n in body)
        inner = copies if mixed else copies * node.length
        for c in body.consts:
            self._define(body, c, inner, free=True)
        carry_in: list[int] = []
        for j, (v, bin_) in enumerate(zip(node.inputs, body.inputs, strict=True)):
            k = self._define(body, bin_.value, inner, body_input=True)
            self.values[k].name_stack = node.name_stack
            outer = self._key(graph, v)
            if outer is not None:
                # consts and xs are the outer tensor itself / its slices; a carry is not
                same = not nc <= j < nc + nk
                self._add(_Op("scan", [outer], [k], home, alias=True, same=same))
            if nc <= j < nc + nk:
                carry_in.append(k)
        self._walk(body, inner, home)
        for t, (out_v, bout) in enumerate(zip(node.outputs, body.outputs, strict=True)):
            inside = self._key(body, bout.value)
            outer = self._define(graph, out_v, copies)
            self.values[outer].name_stack = node.name_stack
            if inside is None:
                continue
            self._add(_Op("scan", [inside], [outer], home, alias=True, same=t >= nk))
            if t < nk:  # loop-carried: iteration i's output is iteration i + 1's input
                self._add(_Op("scan", [inside], [carry_in[t]], home, alias=True))

    # -- analyses -----------------------------------------------------------------------
    def activation_flags(self) -> list[bool]:
        """Whether each value carries batch data or random bits (to a fixed point: loop
        carries feed back)."""
        act = [k in self.data for k in range(len(self.values))]
        changed = True
        while changed:
            changed = False
            for op in self.ops:
                a = op.primitive in RANDOM_BITS and not op.alias
                a = a or any(act[k] for k in op.inputs)
                if a:
                    for k in op.outputs:
                        if not act[k]:
                            act[k] = changed = True
        return act

    def producer_primitive(self, k: int) -> str:
        seen = set()
        while k not in seen:
            seen.add(k)
            prods = self.values[k].producers
            if not prods:
                return "input"
            op = prods[0]
            if not op.alias:
                return op.primitive
            k = op.inputs[0]
        return "scan"  # pragma: no cover - a carry that only feeds itself

    def charge(self, k: int) -> tuple[int, ...]:
        """Layers a stored value is charged to (see the module docstring)."""
        val = self.values[k]
        homes = {op.home for op in val.consumers}
        if len(homes) == 1:
            (h,) = homes
            return h or ()
        prods = val.producers
        if prods and prods[0].home is not None:
            return prods[0].home
        return ()


def _backward_use(node: Node, operand: int) -> tuple[bool, bool]:
    """(read at all, read by a consumer that cannot fuse it) for a backward node's operand,
    looking into loop bodies."""
    if node.primitive != "scan" or not node.body:
        if node.primitive in RECOMPUTE_CONSUMERS:
            return True, False
        return True, True
    body = node.body[0]
    vid = body.inputs[operand].value
    used = materialised = False
    for cid in body.consumers.get(vid, []):
        c = body.nodes[cid]
        for j, v in enumerate(c.inputs):
            if v == vid:
                u, m = _backward_use(c, j)
                used, materialised = used or u, materialised or m
    return used, materialised


def _attention_core(prog: _Program, act: list[bool]) -> set[int]:
    """Values of the attention core (see the module docstring's ``"selective"`` rule)."""
    values = prog.values
    attn = [
        op
        for op in prog.ops
        if op.primitive == "dot_general" and len(op.inputs) == 2 and all(act[k] for k in op.inputs)
    ]
    attn_ids = {id(op) for op in attn}

    def through(op: _Op) -> bool:
        return id(op) not in attn_ids and op.primitive != "dot_general"

    core: set[int] = set()
    for seed in attn:
        out = seed.outputs[0]
        reach = {out}
        stack = [out]
        ends: set[int] = set()
        while stack:
            k = stack.pop()
            for op in values[k].consumers:
                if id(op) in attn_ids:
                    ends.add(k)
                elif through(op):
                    for o in op.outputs:
                        if o not in reach:
                            reach.add(o)
                            stack.append(o)
        if not ends:
            continue
        # Keep the part of the reach that leads to another attention matmul.
        path = set(ends)
        stack = list(ends)
        while stack:
            k = stack.pop()
            for op in values[k].producers:
                if not through(op):
                    continue
                for i in op.inputs:
                    if i in reach and i not in path:
                        path.add(i)
                        stack.append(i)
        path.add(out)
        # Side inputs of the core's own size: dropout mask, its random bits.
        size = values[out].tensor.size
        stack = list(path)
        while stack:
            k = stack.pop()
            for op in values[k].producers:
                if op is seed or not (through(op) or op.primitive in RANDOM_BITS):
                    continue
                for i in op.inputs:
                    if i not in path and values[i].tensor.size == size and not values[i].free:
                        path.add(i)
                        stack.append(i)
        core |= path
    # A loop boundary copies a value in or out of a body: the copy is core too.
    changed = True
    while changed:
        changed = False
        for op in prog.ops:
            if op.alias and (op.inputs[0] in core) != (op.outputs[0] in core):
                core.update((op.inputs[0], op.outputs[0]))
                changed = True
    return core


def _layer_checkpoints(prog: _Program) -> tuple[set[int], set[int]]:
    """Under full remat: (values inside a layer, recomputed from the layer's inputs;
    values entering a layer, which its recomputation starts from and so are stored).

    Inside: produced in a layer and read only by that layer's forward ops. Entering: read
    by a layer's op but produced elsewhere (another layer, the embedding), or a loop
    body's input (the carried residual stream of a scan over layers)."""
    inside: set[int] = set()
    entering: set[int] = set()
    for k, val in enumerate(prog.values):
        if val.free or not val.producers:
            continue
        if val.body_input:
            entering.add(k)
            continue
        home = val.producers[0].home
        if any(op.home != home for op in val.consumers):
            entering.add(k)
        elif home is not None and all(
            op.home == home and not _leaves_body(prog, op) for op in val.consumers
        ):
            inside.add(k)
    return inside, entering


def _leaves_body(prog: _Program, op: _Op) -> bool:
    # A loop's final carry leaves the layer loop; its per-iteration stacked outputs do not
    # (they only feed the backward loop).
    if not op.alias:
        return False
    src, dst = prog.values[op.inputs[0]], prog.values[op.outputs[0]]
    return len(dst.scope) < len(src.scope) and any(c.home != op.home for c in dst.consumers)


# ----------------------------------------------------------------------------- the cut


def _classes(prog: _Program) -> list[int]:
    """A representative per value: a scan's stacked output and its per-iteration body
    value (likewise stacked inputs and their slices, loop constants and the outer value)
    are one tensor, stored once; the representative is the innermost (best named) one."""
    parent = list(range(len(prog.values)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for op in prog.ops:
        if op.same:
            a, b = find(op.inputs[0]), find(op.outputs[0])
            if a != b:
                # keep the deeper scope as the root
                if len(prog.values[a].scope) >= len(prog.values[b].scope):
                    parent[b] = a
                else:
                    parent[a] = b
    return [find(k) for k in range(len(parent))]


def _min_cut(
    prog: _Program, cls: list[int], free: list[bool], banned: list[bool], unsaveable: set[int]
) -> list[tuple[int, int]]:
    """``(representative, bytes)`` of the values to store (minimum bytes; module
    docstring); ``cls``: :func:`_classes`."""
    from ortools.graph.python import max_flow

    n = len(prog.values)
    nbytes = np.zeros(n, dtype=np.int64)
    is_free = np.zeros(n, dtype=bool)
    no_save = np.zeros(n, dtype=bool)
    pinned = np.zeros(n, dtype=bool)
    needed = np.zeros(n, dtype=bool)
    produced = np.zeros(n, dtype=bool)
    big = np.iinfo(np.int64).max
    nbytes[:] = big
    for k, val in enumerate(prog.values):
        c = cls[k]
        # a loop constant inside the body counts once (as the outer value), not L times
        b = val.tensor.nbytes * val.copies
        nbytes[c] = min(nbytes[c], b)
        is_free[c] |= free[k]
        no_save[c] |= k in unsaveable
        pinned[c] |= banned[k] or (val.materialised and k not in unsaveable)
        needed[c] |= val.needed
        produced[c] |= any(not op.same for op in val.producers)
    roots = sorted(set(cls))
    cap = np.zeros(n, dtype=np.int64)
    for c in roots:
        if not is_free[c]:
            # tie-break: among cuts of equal bytes prefer values the backward reads
            cap[c] = int(nbytes[c]) * _SCALE + (0 if needed[c] else 1)
    saveable = [c for c in roots if not is_free[c] and not no_save[c]]
    inf = int(cap[saveable].sum()) + 1
    for c in roots:
        if no_save[c] and not is_free[c]:
            cap[c] = inf
    tails: list[int] = []
    heads: list[int] = []
    caps: list[int] = []

    def arc(t: int, h: int, c: int) -> None:
        tails.append(t)
        heads.append(h)
        caps.append(c)

    source, sink = 2 * n, 2 * n + 1
    for c in roots:
        arc(2 * c, 2 * c + 1, int(cap[c]))
        if (pinned[c] and not no_save[c]) or not produced[c] or is_free[c]:
            arc(source, 2 * c, inf)
        if needed[c]:
            arc(2 * c + 1, sink, inf)
    for op in prog.ops:
        if op.same:
            continue
        for i in op.inputs:
            for o in op.outputs:
                if cls[i] != cls[o]:
                    arc(2 * cls[i] + 1, 2 * cls[o], inf)
    solver = max_flow.SimpleMaxFlow()
    solver.add_arcs_with_capacity(
        np.array(tails, dtype=np.int32), np.array(heads, dtype=np.int32), np.array(caps)
    )
    status = solver.solve(source, sink)
    if status != solver.OPTIMAL:  # pragma: no cover - capacities are bounded above
        raise AutoparError(f"the activation min-cut failed with status {status}; report the graph")
    if solver.optimal_flow() >= inf:  # pragma: no cover - every value reaches a free one
        raise AutoparError(
            "no finite set of stored values serves the backward pass: a value the backward "
            "reads can neither be recomputed nor stored under this remat policy"
        )
    side = np.zeros(2 * n + 2, dtype=bool)
    side[np.asarray(solver.get_source_side_min_cut(), dtype=np.int64)] = True
    return [
        (c, int(nbytes[c])) for c in roots if side[2 * c] and not side[2 * c + 1] and not is_free[c]
    ]


def _sources(prog: _Program, k: int, stored: set[int], free: list[bool]) -> set[int]:
    """The stored values the forward value ``k`` is recomputed from: walking up through
    values that are neither stored nor free."""
    out: set[int] = set()
    seen = {k}
    stack = [k]
    while stack:
        for op in prog.values[stack.pop()].producers:
            for i in op.inputs:
                if i in seen:
                    continue
                seen.add(i)
                if i in stored:
                    out.add(i)
                elif not free[i]:
                    stack.append(i)
    return out


def residuals(
    graph: Graph, remat: Remat = "none", *, recompute_elementwise: bool = True
) -> Residuals:
    """What ``graph`` stores between its forward and its backward pass under ``remat``.

    Residuals (values produced in the forward phase and read in the backward phase, loop
    bodies included) are found on the graph; the stored set is the minimum-byte set from
    which the backward pass gets all of them under ``remat`` (see the module docstring).

    Args:
        graph: a traced training step (``autopar.trace(step, *args)``); a graph without a
            backward phase stores nothing.
        remat: ``"none"``, ``"selective"`` (recompute the attention core) or ``"full"``
            (checkpoint every layer: store only what enters it).
        recompute_elementwise: recompute elementwise values inside fused backward kernels
            (Megatron's accounting; reproduces Korthikanti et al.'s table). ``False``
            stores every value the linearised jaxpr reads: JAX's literal residuals, which
            is what XLA keeps for the compiled step.

    Returns:
        :class:`Residuals`: the stored and rebuilt values; total, per-layer and outside
        bytes, breakdowns.

    Raises:
        InvalidOptionError: ``remat`` is not ``"none"``, ``"selective"`` or ``"full"``.

    Example:
        >>> from autopar.trace import trace
        >>> from benchmarks.models.gpt import GPTConfig, make_train_step
        >>> step, args = make_train_step(GPTConfig(512, 128, 128, 2, 4, dropout=0.1), 2)
        >>> res = residuals(trace(step, *args), "full")
        >>> [b // (128 * 2 * 128) for b in res.layer_bytes]      # 2 s b h per layer
        [2, 2]
    """
    if remat not in REMAT_POLICIES:
        raise InvalidOptionError(f"remat={remat!r} is not a policy; use one of {REMAT_POLICIES}")
    prog = _Program(graph)
    act = prog.activation_flags()
    free = [val.free or not act[k] for k, val in enumerate(prog.values)]
    # banned: computed in the forward pass only (stored if the backward needs it)
    banned = []
    for val in prog.values:
        prim = next((op.primitive for op in val.producers if not op.alias), None)
        banned.append(prim is not None and (not recompute_elementwise or prim not in RECOMPUTABLE))
    unsaveable: set[int] = set()
    if remat == "selective":
        unsaveable = _attention_core(prog, act)
    elif remat == "full":
        unsaveable, entering = _layer_checkpoints(prog)
        banned = [b or k in entering for k, b in enumerate(banned)]
    banned = [b and k not in unsaveable for k, b in enumerate(banned)]
    cls = _classes(prog)
    stored = _min_cut(prog, cls, free, banned, unsaveable)
    members: dict[int, list[int]] = defaultdict(list)
    for k, c in enumerate(cls):
        members[c].append(k)

    def key(k: int) -> Key:
        return prog.values[k].scope, prog.values[k].vid

    layer_bytes = [0] * len(graph.layers)
    outside = 0
    by_prim: dict[str, int] = defaultdict(int)
    by_dtype: dict[str, int] = defaultdict(int)
    saved = []
    kept: set[int] = set()
    for k, nbytes in stored:
        val = prog.values[k]
        layers = prog.charge(k)
        copies = nbytes // val.tensor.nbytes if val.tensor.nbytes else val.copies
        kept.update(members[k])
        sv = SavedValue(
            val.scope, val.vid, val.tensor, copies, prog.producer_primitive(k),
            val.name_stack, layers, tuple(key(m) for m in members[k]),
        )  # fmt: skip
        saved.append(sv)
        by_prim[sv.primitive] += sv.nbytes
        by_dtype[val.tensor.dtype] += sv.nbytes
        if not layers:
            outside += sv.nbytes
            continue
        share, rest = divmod(sv.nbytes, len(layers))
        for j, i in enumerate(layers):
            layer_bytes[i] += share + (1 if j < rest else 0)
    saved.sort(key=lambda s: (-s.nbytes, s.scope, s.value))
    # Where each top-level value the policy rebuilds is recomputed from (the timeline keeps
    # those sources until the recompute).
    sources = {
        key(k): frozenset(key(i) for i in _sources(prog, k, kept, free))
        for k, val in enumerate(prog.values)
        if not val.scope and k not in kept and val.producers
    }
    return Residuals(
        remat=remat,
        recompute_elementwise=recompute_elementwise,
        total_bytes=sum(layer_bytes) + outside,
        layer_bytes=tuple(layer_bytes),
        outside_bytes=outside,
        by_primitive=dict(sorted(by_prim.items(), key=lambda kv: -kv[1])),
        by_dtype=dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        saved=tuple(saved),
        stored=frozenset(key(k) for k in kept),
        computed=frozenset(key(k) for k, val in enumerate(prog.values) if val.producers),
        sources=sources,
    )


__all__ = ["REMAT_POLICIES", "Key", "Remat", "Residuals", "SavedValue", "residuals"]
