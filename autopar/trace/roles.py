"""Input paths, updated-state matching and input roles.

**Paths.** Input ``i`` gets the ``/``-joined keys of ``tree_flatten_with_path((args,
kwargs))``, with the positional index replaced by the parameter's name from
``inspect.signature(fn)`` (``state/params/h_3/attn/q/kernel``, ``batch/tokens``); keyword
arguments start with their keyword. Outputs are ``out/<keys>`` (``out/0/params/...``,
``out/1``; a bare array is ``out``).

**Updated state.** An input subtree whose updated value is returned has an output subtree
with the same relative key paths, shapes and dtypes. :func:`match_updates` tries input
subtrees from the shallowest (a whole argument, e.g. ``state`` against ``new_state``) to
the deepest, pairing each with an unused output subtree of identical signature (ties go to
the output whose keys end like the input's). A single leaf pairs only when its last key
matches too (``.../kernel`` with ``.../kernel``), so ``f(x) -> tanh(x)`` is not "state".

**Roles** (:func:`assign_roles`), after phases are known. Inputs still unpaired (lone
arrays, ``f(w, x) -> (w - lr * g, loss)``) pair, in order, with unpaired outputs of the same
shape and dtype that are computed from gradients without being gradients. A pair whose output is produced
by a backward equation is a *gradient*: its input is a differentiated parameter
(``f(params, x) -> grads``), not state. For state pairs:

* ``param``: read by a forward equation and its new value depends on a backward result;
* ``model_state``: read by the forward, updated without gradients (batch-norm statistics);
* ``opt_state``: not read by the forward (only the optimizer reads it).

Path names break the ties the data flow cannot see: a key ``opt_state``/``optimizer``/
``opt`` means optimizer state (Adam's step counter is read by the forward when it seeds
dropout), ``batch_stats`` means model state, and a float leaf under ``params`` that nothing
reads is still a parameter. Integer and boolean leaves are never parameters. Inputs that
are not state are ``batch`` when they share the common leading (batch) dimension of the
data arguments, else ``other``.
"""

from __future__ import annotations

import inspect
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from autopar.trace.build import RawEqn, is_float_dtype
from autopar.trace.graph import InputRole, Phase, TensorInfo

_OPT_NAMES = frozenset({"opt_state", "optimizer", "opt", "optim", "optimizer_state"})
_MODEL_STATE_NAMES = frozenset({"batch_stats", "model_state", "buffers", "cache"})
_PARAM_NAMES = frozenset({"params", "param", "weights", "variables"})
# Argument names that never hold batch data, even without gradients.
_NOT_BATCH_ARGS = _PARAM_NAMES | _OPT_NAMES | {"state", "model", "opt_state", "train_state"}

Path = tuple[str, ...]


def key_name(key: Any) -> str:
    """A path key as text: dict keys and attribute names as-is, sequence indices as digits.

    Example:
        >>> key_name(jax.tree_util.DictKey("params")), key_name(jax.tree_util.SequenceKey(2))
        ('params', '2')
    """
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def positional_names(fn: Callable, n: int) -> list[str]:
    """Names of the first ``n`` positional parameters of ``fn`` (``arg{i}`` if unknown).

    Example:
        >>> positional_names(lambda state, batch: None, 2)
        ['state', 'batch']
        >>> positional_names(lambda *xs: None, 2)
        ['xs_0', 'xs_1']
    """
    names: list[str] = []
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        var: str | None = None
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind == p.VAR_POSITIONAL:
                var = p.name
                break
        if var is not None:
            names.extend(f"{var}_{j}" for j in range(n - len(names)))
    names = names[:n]
    names.extend(f"arg{i}" for i in range(len(names), n))
    return names


def input_paths(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Path]:
    """Key paths of the flattened ``(args, kwargs)``, the first key named after the argument."""
    leaves, _ = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
    names = positional_names(fn, len(args))
    out: list[Path] = []
    for kp, _leaf in leaves:
        which = key_name(kp[0])
        if which == "0":
            head = names[int(key_name(kp[1]))]
        else:
            head = key_name(kp[1])
        out.append((head, *(key_name(k) for k in kp[2:])))
    return out


def output_paths(out_shape: Any) -> list[Path]:
    """Key paths of the flattened outputs (without the ``out`` prefix)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(out_shape)
    return [tuple(key_name(k) for k in kp) for kp, _leaf in leaves]


def path_str(path: Path, prefix: str = "") -> str:
    """``/``-joined path, optionally prefixed (``out``)."""
    parts = ([prefix] if prefix else []) + list(path)
    return "/".join(parts)


def _groups(paths: Sequence[Path], min_depth: int) -> dict[Path, list[int]]:
    groups: dict[Path, list[int]] = {}
    for i, p in enumerate(paths):
        for d in range(min_depth, len(p) + 1):
            groups.setdefault(p[:d], []).append(i)
    return groups


def _signature(prefix: Path, leaves: list[int], paths: Sequence[Path], tensors) -> tuple:
    n = len(prefix)
    return tuple((paths[i][n:], tensors[i].shape, tensors[i].dtype) for i in leaves)


def _suffix_match(a: Path, b: Path) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def match_updates(
    in_paths: Sequence[Path],
    in_tensors: Sequence[TensorInfo],
    out_paths: Sequence[Path],
    out_tensors: Sequence[TensorInfo],
) -> dict[int, int]:
    """Pair input leaves with the output leaves that have the same place in a matching
    subtree (see the module docstring). Returns ``{input index: output index}``.

    Example:
        >>> t = TensorInfo((2,), "float32")
        >>> match_updates([("state", "w"), ("x",)], [t, t], [("0", "w"), ("1",)], [t, t])
        {0: 0}
    """
    in_groups = _groups(in_paths, 1)
    out_groups = _groups(out_paths, 0)
    out_by_sig: dict[tuple, list[Path]] = defaultdict(list)
    for prefix, leaves in out_groups.items():
        out_by_sig[_signature(prefix, leaves, out_paths, out_tensors)].append(prefix)
    order = sorted(in_groups, key=lambda p: (len(p), in_groups[p][0]))
    pairs: dict[int, int] = {}
    used_out: set[int] = set()
    for prefix in order:
        leaves = in_groups[prefix]
        if any(i in pairs for i in leaves):
            continue
        sig = _signature(prefix, leaves, in_paths, in_tensors)
        cands = [
            op for op in out_by_sig.get(sig, ()) if not any(o in used_out for o in out_groups[op])
        ]
        if len(leaves) == 1 and len(in_paths[leaves[0]]) == len(prefix):
            # a lone leaf: its name must match too (e.g. ``kernel``), never a bare index
            last = prefix[-1]
            if last.isdigit() or len(prefix) < 2:
                continue
            cands = [op for op in cands if op and op[-1] == last]
        if not cands:
            continue
        best = max(
            cands,
            key=lambda op: (
                bool(op) and op[-1] == prefix[-1],
                _suffix_match(prefix[1:], op),
                -out_groups[op][0],
            ),
        )
        for i, o in zip(leaves, out_groups[best], strict=True):
            pairs[i] = o
            used_out.add(o)
    return pairs


def assign_roles(
    *,
    in_paths: Sequence[Path],
    in_tensors: Sequence[TensorInfo],
    in_values: Sequence[int],
    out_values: Sequence[int],
    out_tensors: Sequence[TensorInfo],
    pairs: dict[int, int],
    eqns: Sequence[RawEqn],
    phases: Sequence[Phase],
    tainted: set[int],
) -> list[tuple[InputRole, int | None]]:
    """``(role, output_index)`` per input (see the module docstring for the rules).

    Args:
        in_paths / in_tensors / in_values: the flat inputs (paths, shapes, value ids).
        out_values / out_tensors: value id (``-1`` for literals) and shape of each output.
        pairs: :func:`match_updates`' result.
        eqns / phases: the top-level equations and their phases.
        tainted: value ids computed from a backward result.
    """
    producer: dict[int, int] = {}
    read_fwd: set[int] = set()
    for e, ph in zip(eqns, phases, strict=True):
        for v in e.outputs:
            producer[v] = e.index
        if ph == "forward":
            read_fwd.update(v for v in e.inputs if v >= 0)

    pairs = dict(pairs)
    # Lone arrays (``f(w, x) -> (w - lr * g, loss)``) have no key names to match on: pair a
    # float input the forward reads with the first unpaired output of the same shape and
    # dtype that is computed from gradients (but is not a gradient itself), in order.
    used = set(pairs.values())
    updated = [
        o
        for o, vid in enumerate(out_values)
        if o not in used
        and vid in tainted
        and vid in producer
        and phases[producer[vid]] != "backward"
    ]
    for i, (t, vid) in enumerate(zip(in_tensors, in_values, strict=True)):
        if i in pairs or vid not in read_fwd or not is_float_dtype(t.dtype):
            continue
        o = next((o for o in updated if out_tensors[o] == t), None)
        if o is not None:
            pairs[i] = o
            updated.remove(o)

    state: dict[int, int] = {}
    differentiated: set[int] = set()
    for i, o in pairs.items():
        vid = out_values[o]
        p = producer.get(vid)
        if vid >= 0 and p is not None and phases[p] == "backward" and vid != in_values[i]:
            differentiated.add(i)  # the output is this input's gradient
        else:
            state[i] = o

    roles: list[tuple[InputRole, int | None]] = []
    undecided: list[int] = []
    for i, (path, t, vid) in enumerate(zip(in_paths, in_tensors, in_values, strict=True)):
        names = set(path[:-1]) if len(path) > 1 else set()
        is_float = is_float_dtype(t.dtype)
        if i in state:
            o = state[i]
            reads = vid in read_fwd
            if names & _OPT_NAMES:
                role: InputRole = "opt_state"
            elif names & _MODEL_STATE_NAMES:
                role = "model_state"
            elif reads and is_float and out_values[o] in tainted:
                role = "param"
            elif reads:
                role = "model_state"
            elif is_float and names & _PARAM_NAMES and path[0] not in _OPT_NAMES:
                role = "param"  # a parameter the loss does not use: still a parameter
            else:
                role = "opt_state"
            roles.append((role, o))
        elif i in differentiated and is_float:
            roles.append(("param", None))
        else:
            roles.append(("other", None))
            undecided.append(i)

    # Batch data: non-state inputs sharing the most common leading dimension.
    cands = [
        i for i in undecided if in_tensors[i].ndim >= 1 and in_paths[i][0] not in _NOT_BATCH_ARGS
    ]
    if cands:
        lead = Counter(in_tensors[i].shape[0] for i in cands).most_common(1)[0][0]
        for i in cands:
            if in_tensors[i].shape[0] == lead:
                roles[i] = ("batch", None)
    return roles
