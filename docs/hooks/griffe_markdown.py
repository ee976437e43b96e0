"""A griffe extension: read the code base's docstrings as Google style with Markdown.

Two rewrites, made before griffe parses a docstring (loaded by ``mkdocs.yml``:
``plugins.mkdocstrings.handlers.python.options.extensions``):

* ``Example:`` (singular, how this code base titles its doctests) becomes ``Examples:``.
  griffe's Google parser knows only the plural as the section whose ``>>>`` lines are
  code; it renders the singular as a plain admonition, where doctest output such as
  ``[1, 2]`` reads as a Markdown link.
* Sphinx roles (``:func:`plan```, ``:class:`~autopar.plan.Plan```) become inline code
  (`` `plan` ``, `` `Plan` ``): Markdown has no roles, and the targets are named for
  readers, not always resolvable as cross-references.

Example:
    >>> markdown_docstring("Uses :func:`~a.b.c`.\\n\\nExample:\\n    >>> 1\\n    1")
    'Uses `c`.\\n\\nExamples:\\n    >>> 1\\n    1'
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^([ \t]*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def _role(m: re.Match[str]) -> str:
    target = m.group(2)
    return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with ``Example:`` titled ``Examples:`` and Sphinx roles as inline code."""
    return _ROLE.sub(_role, _EXAMPLE.sub(r"\1Examples:", text))


class MarkdownDocstrings(griffe.Extension):
    """Apply :func:`markdown_docstring` to every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring (if any) before it is parsed."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
