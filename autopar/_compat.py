"""autopar's only contact with JAX internals (``jax._src``) and version-specific behaviour.

Everything else goes through public JAX (``jax.extend.core`` included) or this module, so a
JAX upgrade touches one file.

Measured on JAX 0.10.2: ``str(eqn.source_info.name_stack)`` gives ``"jvp(GPT)/h_0/attn"``;
a name stack is relative to the jaxpr it sits in (callers prepend their own); call-like
primitives are ``jit`` (``pjit`` before 0.7), ``closed_call``, ``core_call``,
``custom_jvp_call``, ``custom_vjp_call`` and ``remat2`` (``jax.checkpoint``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax._src import source_info_util

# Call-like primitives whose body is spliced into the caller (same semantics when evaluated).
INLINED_PRIMITIVES: frozenset[str] = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
    }
)

# Control flow kept as one composite equation; its bodies (in ``jaxprs_in_params`` order,
# i.e. parameter order) are inlined recursively.
COMPOSITE_BODY_PARAMS: dict[str, tuple[str, ...]] = {
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
}


def call_body(eqn: Any) -> tuple[Any, list[Any]]:
    """``(open jaxpr, consts)`` of a call-like equation (see :data:`INLINED_PRIMITIVES`)."""
    params = eqn.params
    body = params.get("jaxpr", params.get("call_jaxpr"))
    if body is None:  # pragma: no cover - defensive: an unknown call-like spelling
        raise KeyError(f"{eqn.primitive.name} has no 'jaxpr'/'call_jaxpr' parameter")
    if hasattr(body, "consts"):  # ClosedJaxpr
        return body.jaxpr, list(body.consts)
    return body, []


def name_stack_of(source_info: Any) -> Any:
    """The ``NameStack`` object of a ``SourceInfo``."""
    return source_info.name_stack


def empty_name_stack() -> Any:
    return source_info_util.NameStack()


def with_name_prefix(source_info: Any, prefix: Any) -> Any:
    """``source_info`` with ``prefix`` (a ``NameStack``) prepended to its name stack."""
    if prefix is None or not len(prefix):
        return source_info
    return source_info.replace(name_stack=prefix + source_info.name_stack)


@contextlib.contextmanager
def eqn_context(eqn: Any) -> Iterator[None]:
    """What ``jax.core.eval_jaxpr`` wraps a bind in: the equation's name stack (relative to
    the current one), traceback and context (compute type, metadata)."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        yield
