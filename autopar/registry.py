"""Models by name: the ``autopar.models`` entry-point group, or an import path.

A *model family* is any object, usually a module, with

* ``preset(name, **overrides) -> config``, raising ``ValueError`` for an unknown name, and
* ``make_train_step(config, batch_size, abstract=True, seed=0) -> (step_fn, (state, batch))``,
  where ``step_fn(state, batch) -> (new_state, loss)`` is a plain single-device train step
  and ``abstract=True`` gives ``jax.ShapeDtypeStruct`` arguments (nothing allocated).

A package registers its families in its ``pyproject.toml``; this project registers the
model zoo of ``benchmarks`` that way::

    [project.entry-points."autopar.models"]
    gpt = "benchmarks.models.gpt"

``autopar trace gpt`` and ``autopar demo`` find the name here and import the family only
then, so the library never imports a model package itself. A name that is not registered
but holds a ``.`` or a ``:`` is an import path (``mypkg.models.bert`` or
``mypkg.zoo:bert``), so an unregistered family works too. Entry points are package
metadata: after editing them, reinstall (``pip install -e .``).

Example:
    >>> "gpt" in model_names()
    True
    >>> m = model_step("mlp", "tiny", batch_size=4)
    >>> m.args[1]["x"].shape
    (4, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol

from autopar.errors import InvalidOptionError

__all__ = ["MODEL_GROUP", "ModelFamily", "ModelStep", "load_model", "model_names", "model_step"]

MODEL_GROUP = "autopar.models"
"""The entry-point group that names model families."""


class ModelFamily(Protocol):
    """What :func:`load_model` returns: named configurations and a train step for each."""

    def preset(self, name: str, /, **overrides: Any) -> Any: ...

    def make_train_step(
        self, config: Any, batch_size: int, abstract: bool = True, seed: int = 0
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]: ...


@dataclass(frozen=True)
class ModelStep:
    """One model's train step and its arguments, as :func:`model_step` builds them.

    Attributes:
        name: the registered name or import path it was looked up by.
        preset: the preset name.
        config: the family's configuration object for that preset.
        step_fn: ``step_fn(*args) -> (new_state, loss)``.
        args: the arguments, ``(state, batch)`` for the zoo's models.
    """

    name: str
    preset: str
    config: Any
    step_fn: Callable[..., Any]
    args: tuple[Any, ...]


def model_names() -> tuple[str, ...]:
    """The names registered under the ``autopar.models`` entry-point group, sorted."""
    return tuple(sorted({ep.name for ep in entry_points(group=MODEL_GROUP)}))


def load_model(name: str) -> ModelFamily:
    """The model family registered as ``name``, or at the import path ``name``.

    Raises:
        InvalidOptionError: ``name`` is neither registered nor an importable path, or what
            it names lacks ``preset`` / ``make_train_step``.
    """
    found = entry_points(group=MODEL_GROUP, name=name)
    if found:
        ep = next(iter(found))
    elif "." in name or ":" in name:
        ep = EntryPoint(name=name, value=name, group=MODEL_GROUP)
    else:
        raise InvalidOptionError(
            f"model {name!r} is unknown; registered ({MODEL_GROUP!r} entry points): "
            f"{', '.join(model_names()) or 'none (is the package installed?)'}. "
            "An unregistered model can be given by import path, e.g. mypkg.models.bert."
        )
    try:
        family = ep.load()
    except (ImportError, AttributeError) as e:
        raise InvalidOptionError(f"model {name!r}: cannot load {ep.value!r}: {e}") from e
    missing = [a for a in ("preset", "make_train_step") if not callable(getattr(family, a, None))]
    if missing:
        raise InvalidOptionError(
            f"model {name!r} ({ep.value}) is not a model family: it lacks {', '.join(missing)} "
            f"(see {__name__})."
        )
    return family


def model_step(
    name: str, preset: str, batch_size: int, *, abstract: bool = True, seed: int = 0
) -> ModelStep:
    """Build the train step of model ``name`` (see :func:`load_model`) at ``preset``.

    Raises:
        InvalidOptionError: the model is unknown, or its family rejects ``preset``.
    """
    family = load_model(name)
    try:
        config = family.preset(preset)
    except ValueError as e:  # model families need not depend on autopar: plain ValueError
        raise InvalidOptionError(f"model {name!r}, preset {preset!r}: {e}") from e
    step_fn, args = family.make_train_step(config, batch_size, abstract=abstract, seed=seed)
    return ModelStep(name=name, preset=preset, config=config, step_fn=step_fn, args=args)
