"""The schema read back: every leaf field with its type, default and docstring (the CLI's flags
and help, and docs/cli.md, are generated from these), and how a type reads in an error."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from functools import cache
from typing import Any, Literal

from tierlm.config.schema import Config


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_fields() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field of `Config`."""
    out = []
    top_hints = type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = top_hints[section.name]
        hints = type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{section.name}.{f.name}", hints[f.name], default, docs.get(f.name, "")))
    return out


def describe_type(tp: Any) -> str:
    """How a field's allowed values read in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " (or empty)"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )

