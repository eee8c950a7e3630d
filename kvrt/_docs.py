"""Per-field documentation for ``help()``: a Struct's field docstrings (the string right
after each field) are appended to its class docstring, since Python keeps no attribute
docstrings at run time."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

__all__ = ["document_fields"]


def document_fields(cls: type[Any]) -> None:
    """Append a ``Fields`` section to ``cls.__doc__`` listing each annotated field, its
    type and its docstring (nothing happens where the source cannot be read)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return
    body = ast.parse(source).body[0]
    if not isinstance(body, ast.ClassDef):
        return
    lines = []
    nodes = body.body
    for node, after in zip(nodes, [*nodes[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            doc = " ".join(inspect.cleandoc(after.value.value).split())
        kind = ast.unparse(node.annotation)
        lines.append(f"{node.target.id} ({kind})" + (f"\n    {doc}" if doc else ""))
    if lines:
        cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\nFields:\n\n" + "\n".join(lines)
