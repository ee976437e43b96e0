"""Save and restore a sharded train state under a plan, with Orbax.

A checkpoint directory holds numbered steps (``DIR/1``, ``DIR/2``, ...), each written by
``orbax.checkpoint`` to a temporary directory and renamed into place only once complete:
a save that dies midway (killed, out of disk, preempted) leaves the steps before it
readable and is ignored by :func:`steps`, :func:`latest_step` and :func:`restore`. Each
process writes only its own shards, so a state sharded over several processes
(``jax.distributed``) is saved without gathering it; every process calls :func:`save`
and :func:`restore` alike.

A step stores the state and, when given, the plan it was laid out by (:func:`saved_plan`).
Restoring does not need that plan: the state is restored into whatever layout the caller
asks for, on whatever devices, so a job that lost a node re-plans for the devices it has
left and restores into the new plan (the elastic case)::

    autopar.checkpoint.save("ckpt", state, plan, step=100)          # 8 devices
    ...
    plan4 = autopar.plan(step, state, batch, cluster=Cluster.local(jax.devices()[:4]))
    state = autopar.checkpoint.restore("ckpt", plan4, devices=jax.devices()[:4])

Example:
    >>> ckpt = tmp_dir / "ckpt"
    >>> autopar.checkpoint.save(ckpt, state, plan, step=1).name
    '1'
    >>> restored = autopar.checkpoint.restore(ckpt, plan)   # laid out as `plan` says
    >>> w = restored["params"]["layer_0"]["w"]
    >>> bool((w == state["params"]["layer_0"]["w"]).all()), w.sharding.num_devices
    (True, 8)
    >>> autopar.checkpoint.steps(ckpt), autopar.checkpoint.saved_plan(ckpt) == plan
    ((1,), True)
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

from autopar.errors import AutoparError
from autopar.plan import Plan, TensorSharding, to_partition_spec

PathLike = str | os.PathLike
_STATE = "state"  # the Orbax items of one step
_PLAN = "plan"


class SaveCheckpointError(AutoparError):
    """A state could not be saved: a leaf that is not an array, a step that exists already,
    a bad step number or directory."""


class RestoreCheckpointError(AutoparError):
    """A checkpoint could not be restored: no such step, or the target (plan, shardings,
    ``like``) does not describe the saved state."""


# ------------------------------------------------------------------------------ manager


def _manager(directory: PathLike, *, keep: int | None = None, create: bool = False) -> Any:
    import orbax.checkpoint as ocp  # lazily: orbax and tensorstore take seconds to import

    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def steps(directory: PathLike) -> tuple[int, ...]:
    """The committed steps in ``directory``, oldest first (a save that died midway is not
    one of them); ``()`` when there is none or no such directory.

    Example:
        >>> autopar.checkpoint.steps(tmp_dir / "nothing-here")
        ()
    """
    if not os.path.isdir(directory):
        return ()
    with _manager(directory) as mgr:
        return tuple(sorted(mgr.all_steps()))


def latest_step(directory: PathLike) -> int | None:
    """The newest committed step in ``directory``, or ``None``.

    Example:
        >>> autopar.checkpoint.latest_step(tmp_dir / "nothing-here") is None
        True
    """
    done = steps(directory)
    return done[-1] if done else None


# ------------------------------------------------------------------------------- save


def _check_leaves(state: Any) -> None:
    ok = (jax.Array, np.ndarray, np.generic, int, float, bool)
    for kp, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not isinstance(leaf, ok):
            raise SaveCheckpointError(
                f"state leaf {jax.tree_util.keystr(kp)} is a {type(leaf).__name__}, not an "
                "array or number; keep only arrays in the state you save (put other values "
                "in a separate file)."
            )


def _plan_of(plan: Any) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    inner = getattr(plan, "plan", None)  # a LoweredStep
    if isinstance(inner, Plan):
        return inner
    raise SaveCheckpointError(
        f"plan={plan!r} must be an autopar.Plan, a lowered step (train_step.lower(...)) or None."
    )


def save(
    directory: PathLike,
    state: Any,
    plan: Plan | Any | None = None,
    *,
    step: int,
    keep: int | None = None,
) -> pathlib.Path:
    """Save ``state`` (a pytree of arrays, sharded or not) as ``step`` of ``directory``.

    The step appears only once it is complete (written to a temporary directory, then
    renamed): killed midway, the previous steps stay readable. Each process writes its own
    shards; with several processes every one of them calls ``save``. Returns once written.

    Args:
        directory: the checkpoint directory (created if missing).
        state: the pytree to save, e.g. the train state a decorated step returned.
        plan: the :class:`~autopar.Plan` the state is laid out by (or the lowered step
            holding it), stored beside the state for :func:`saved_plan`; optional.
        step: the step number (>= 0), new in ``directory``.
        keep: keep only the newest ``keep`` steps (older ones are deleted after this save);
            ``None`` keeps every step.

    Returns:
        The step's directory.

    Raises:
        SaveCheckpointError: a leaf is not an array, ``step`` exists already or is not
            an int >= 0, ``keep`` < 1.

    Example:
        >>> path = autopar.checkpoint.save(tmp_dir / "run", state, step=0)
        >>> autopar.checkpoint.save(tmp_dir / "run", state, step=0)
        Traceback (most recent call last):
        ...
        autopar.checkpoint.SaveCheckpointError: step 0 exists already in ...
    """
    import orbax.checkpoint as ocp

    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise SaveCheckpointError(f"step={step!r} must be an int >= 0.")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise SaveCheckpointError(f"keep={keep!r} must be an int >= 1, or None (keep all).")
    _check_leaves(state)
    plan = _plan_of(plan)
    items = {_STATE: ocp.args.StandardSave(state)}
    if plan is not None:
        items[_PLAN] = ocp.args.JsonSave(plan.to_dict())
    with _manager(directory, keep=keep, create=True) as mgr:
        if int(step) in mgr.all_steps():
            raise SaveCheckpointError(
                f"step {step} exists already in {os.fspath(directory)!r} (steps "
                f"{sorted(mgr.all_steps())}); save under a new step number, or delete it."
            )
        mgr.save(int(step), args=ocp.args.Composite(**items))
        mgr.wait_until_finished()
        return pathlib.Path(mgr.directory) / str(int(step))


# ----------------------------------------------------------------------------- restore


def _records(plan: Plan, arg: int | str) -> tuple[str, list[TensorSharding], int]:
    """The plan's input records of argument ``arg`` (its name or position)."""
    heads: list[str] = []
    for r in plan.inputs:
        head = r.path.split("/", 1)[0]
        if head not in heads:
            heads.append(head)
    if isinstance(arg, str):
        if arg not in heads:
            raise RestoreCheckpointError(
                f"the plan has no argument named {arg!r}; its arguments are {heads}."
            )
        index = heads.index(arg)
    elif isinstance(arg, int) and 0 <= arg < len(heads):
        index = arg
    else:
        raise RestoreCheckpointError(
            f"arg={arg!r}: the plan has {len(heads)} arguments {heads}; give a position or a name."
        )
    head = heads[index]
    return head, [r for r in plan.inputs if r.path.split("/", 1)[0] == head], index


def _record_tree(plan: Plan, head: str, recs: list, index: int, like: Any) -> Any:
    """The records of one argument, in its pytree structure (from ``like`` or the plan's
    bound ``in_tree``)."""
    from autopar.lower.lowering import leaf_paths

    if like is not None:
        by_path = {r.path: r for r in recs}
        leaves, tree = jax.tree_util.tree_flatten(like)
        paths = leaf_paths((like,), [head])
        missing = [p for p in paths if p not in by_path]
        if missing or len(paths) != len(recs):
            raise RestoreCheckpointError(
                f"like= does not match the plan's argument {head!r} ({len(recs)} leaves, "
                f"like has {len(paths)}); first unmatched: "
                f"{(missing or sorted(set(by_path) - set(paths)))[:1]}. Pass the state "
                "the plan was made for."
            )
        return jax.tree_util.tree_unflatten(tree, [by_path[p] for p in paths])
    if plan.in_tree is not None:
        # ``in_tree`` is the structure of ``(args, kwargs)`` the step was traced with.
        args, kwargs = jax.tree_util.tree_unflatten(plan.in_tree, list(plan.inputs))
        items = [*args, *(kwargs[k] for k in sorted(kwargs))]
        if len(items) > index:
            return items[index]
    raise RestoreCheckpointError(
        "this plan was loaded from JSON and does not know the state's pytree structure: "
        "pass like=state (arrays or jax.ShapeDtypeStruct, e.g. from jax.eval_shape)."
    )


def shardings(
    plan: Plan,
    like: Any = None,
    *,
    arg: int | str = 0,
    devices: Sequence[Any] | None = None,
    mesh: Mesh | None = None,
) -> Any:
    """The planned layout of one argument of the step, as a pytree of
    ``jax.ShapeDtypeStruct`` with ``NamedSharding`` (what :func:`restore` restores into).

    Args:
        plan: the plan.
        like: the argument's pytree (arrays or ``jax.ShapeDtypeStruct``), for its
            structure; optional for a plan from ``autopar.plan`` / ``plan_for`` (which
            knows it), needed for one loaded from JSON.
        arg: which argument of the step: position or name (default: the first).
        devices: the devices of the mesh (default ``jax.devices()``; their number must be
            the plan's device count, e.g. the 4 left of 8).
        mesh: a ready mesh with the plan's axes instead of ``devices``.

    Example:
        >>> target = autopar.checkpoint.shardings(plan, state)
        >>> target["params"]["layer_0"]["w"].sharding.mesh.shape == plan.mesh
        True
    """
    from autopar.lower.mesh import make_mesh

    if not isinstance(plan, Plan):
        raise RestoreCheckpointError(f"plan={plan!r} must be an autopar.Plan.")
    if mesh is None:
        mesh = make_mesh(plan.mesh, devices)
    elif dict(mesh.shape) != dict(plan.mesh):
        raise RestoreCheckpointError(f"mesh {dict(mesh.shape)} is not the plan's {plan.mesh}.")
    head, recs, index = _records(plan, arg)
    tree = _record_tree(plan, head, recs, index, like)
    return jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(
            tuple(r.shape),
            _dtype(r.dtype),
            sharding=NamedSharding(mesh, to_partition_spec(r.spec)),
        ),
        tree,
    )


def _target(
    target: Any, like: Any, arg: int | str, devices: Sequence[Any] | None, mesh: Mesh | None
) -> Any:
    """``target`` as a pytree of ``jax.ShapeDtypeStruct`` with shardings."""
    if isinstance(target, Plan):
        return shardings(target, like, arg=arg, devices=devices, mesh=mesh)
    if hasattr(target, "abstract_args") and hasattr(target, "in_shardings"):  # LoweredStep
        if not isinstance(arg, int) or not 0 <= arg < len(target.abstract_args):
            raise RestoreCheckpointError(
                f"arg={arg!r}: the lowered step takes {len(target.abstract_args)} dynamic "
                "arguments; give the position of the state."
            )
        return target.abstract_args[arg]

    def one(x: Any, shape_of: Any = None) -> jax.ShapeDtypeStruct:
        if isinstance(x, Sharding):
            if shape_of is None:
                raise RestoreCheckpointError(
                    "a target of shardings needs like= (the state's arrays or "
                    "jax.ShapeDtypeStruct) for the shapes and dtypes."
                )
            return jax.ShapeDtypeStruct(np.shape(shape_of), shape_of.dtype, sharding=x)
        sharding = getattr(x, "sharding", None)
        if sharding is None or not hasattr(x, "shape"):
            raise RestoreCheckpointError(
                f"target leaf {x!r} has no sharding: give a Plan, a lowered step, or a "
                "pytree of shardings, jax.Arrays or jax.ShapeDtypeStruct(..., sharding=...)."
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    is_sharding = lambda x: isinstance(x, Sharding)  # noqa: E731
    if like is not None:
        return jax.tree.map(one, target, like, is_leaf=is_sharding)
    return jax.tree.map(one, target, is_leaf=is_sharding)


def _dtype(name: str) -> Any:
    """The dtype a plan record names: numpy's (``bfloat16`` included), or a typed PRNG
    key's (``key<fry>``) among JAX's built-in implementations."""
    from autopar.trace.tensor import KEY_IMPLS

    try:
        return np.dtype(name)
    except TypeError:
        pass
    if name in KEY_IMPLS:
        impl = KEY_IMPLS[name][0]
        return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
    raise RestoreCheckpointError(
        f"the plan names dtype {name!r}, which is neither numpy's nor a JAX PRNG key's: "
        "restore into a pytree of jax.ShapeDtypeStruct instead of the plan."
    )


def restore(
    directory: PathLike,
    target: Plan | Any,
    *,
    step: int | None = None,
    like: Any = None,
    arg: int | str = 0,
    devices: Sequence[Any] | None = None,
    mesh: Mesh | None = None,
) -> Any:
    """Restore a saved state into the layout ``target`` describes.

    The layout need not be the one it was saved with: another mesh, another device count
    (restore a state saved on 8 devices onto the 4 left), another plan. Values come back
    bit for bit.

    Args:
        directory: the checkpoint directory.
        target: the layout to restore into: a :class:`~autopar.Plan` (the step's
            argument ``arg`` as that plan lays it out on ``devices`` / ``mesh``), a lowered
            step (``train_step.lower(state, batch)``: its argument ``arg``), or a pytree
            of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``, ``jax.Array``
            (their layouts) or shardings (with ``like`` for shapes).
        step: which step (default: the newest committed one).
        like: the state's pytree (arrays or ``jax.ShapeDtypeStruct``): its structure for a
            plan loaded from JSON, its shapes for a target of shardings.
        arg: the state's position or name among the step's arguments (default 0).
        devices: the devices a :class:`~autopar.Plan` target is laid out on (default all).
        mesh: a ready mesh for a :class:`~autopar.Plan` target instead of ``devices``.

    Returns:
        The state: a pytree of ``jax.Array`` laid out as ``target`` says.

    Raises:
        RestoreCheckpointError: no committed step (or not ``step``) in ``directory``; the
            target does not describe the saved state (structure, shapes).

    Example:
        >>> ckpt = tmp_dir / "ckpt"
        >>> _ = autopar.checkpoint.save(ckpt, state, step=3)
        >>> four = autopar.checkpoint.shardings(                  # another plan, 4 devices
        ...     autopar.baselines.data_parallel(step, {"data": 4}, state, batch), state,
        ...     devices=jax.devices()[:4])
        >>> back = autopar.checkpoint.restore(ckpt, four)
        >>> back["params"]["layer_0"]["w"].sharding.num_devices
        4
        >>> autopar.checkpoint.restore(ckpt, four, step=7)
        Traceback (most recent call last):
        ...
        autopar.checkpoint.RestoreCheckpointError: no step 7 in ...: its steps are [3].
    """
    import orbax.checkpoint as ocp

    done = steps(directory)
    if not done:
        raise RestoreCheckpointError(
            f"no committed checkpoint in {os.fspath(directory)!r}"
            + ("" if os.path.isdir(directory) else " (no such directory)")
            + "; save one with autopar.checkpoint.save(...)."
        )
    if step is None:
        step = done[-1]
    elif step not in done:
        raise RestoreCheckpointError(
            f"no step {step} in {os.fspath(directory)!r}: its steps are {list(done)}."
        )
    abstract = _target(target, like, arg, devices, mesh)
    with _manager(directory) as mgr:
        try:
            restored = mgr.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
            )
        except (ValueError, KeyError, TypeError) as e:
            raise RestoreCheckpointError(
                f"step {step} of {os.fspath(directory)!r} does not fit the target layout "
                f"({type(e).__name__}: {str(e)[:500]}); restore into a plan or shardings "
                "of the state that was saved."
            ) from e
    return restored[_STATE]


def saved_plan(directory: PathLike, step: int | None = None) -> Plan | None:
    """The plan saved with ``step`` (default: the newest), or ``None`` if none was given.

    The plan comes back unbound (as from JSON): pass ``like=`` to :func:`shardings` or
    :func:`restore` when restoring into it.

    Example:
        >>> _ = autopar.checkpoint.save(tmp_dir / "c", state, plan, step=5)
        >>> autopar.checkpoint.saved_plan(tmp_dir / "c").mesh == plan.mesh
        True
    """
    import orbax.checkpoint as ocp

    done = steps(directory)
    step = done[-1] if step is None and done else step
    if step not in done:
        raise RestoreCheckpointError(
            f"no step {step} in {os.fspath(directory)!r}: its steps are {list(done)}."
        )
    path = pathlib.Path(os.path.abspath(os.fspath(directory))) / str(step) / _PLAN
    if not path.exists():
        return None
    with _manager(directory) as mgr:
        raw = mgr.restore(step, args=ocp.args.Composite(**{_PLAN: ocp.args.JsonRestore()}))
    return Plan.from_dict(raw[_PLAN])


__all__ = [
    "RestoreCheckpointError",
    "SaveCheckpointError",
    "latest_step",
    "restore",
    "save",
    "saved_plan",
    "shardings",
    "steps",
]
