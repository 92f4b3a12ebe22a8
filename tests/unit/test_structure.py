"""The package's structure, read from its AST (STYLE.md 20: hold parts, do not inherit them), as a
ratchet: what the package does today that the rules refuse is listed in ``KNOWN`` with its reason,
and the list may only shrink.

* ``inherit``: a class of the package inherits another class of the package only if that base is
  an exception, a ``typing.Protocol``, a dataclass without methods, or on ``ALLOWED`` with its
  reason. Bases from outside the package (``nn.Module``, ``threading.Thread``, ``StrEnum``, HF,
  Lightning) are never flagged. Each base is resolved through its module's imports.
* ``wiring``: no collaborator is wired onto another object after its construction (collaborators
  are passed to constructors): neither a lambda, a local function or a bound method assigned to an
  attribute of another object, nor anything assigned to an attribute that the object's class takes
  as a collaborator in its constructor (a callable, a list of them, an object of a package class
  that is not a dataclass). ``self.x = ...`` in its own class is fine; ``checkpointless/integrations/``
  may patch the host library's own objects.
* ``attributes``: every attribute of a package class, public or private, is written only in the
  file of the class that owns it (the class highest in the package's hierarchy that writes it on
  ``self`` or declares it): through ``self`` in that file, or by its constructor. Elsewhere the
  class's own methods make the change, named for what it means. A frozen dataclass or a
  ``NamedTuple`` owns nothing here (its attributes cannot be written). The object written is typed
  where the source says it (a parameter's annotation, a constructor call, ``self.x = X(...)``, an
  annotated attribute, a function's return annotation, an import); one of another library's types
  (``argparse.Namespace``, a ``torch`` parameter, ``threading.local``) is not the package's; an
  object of unknown type is judged by the attribute's name (any package class that writes it).

A violation not on the list fails (fix it, or list it with a reason as a stated decision); an
entry that is no longer a violation fails too (delete it: the list only shrinks). Entries are
keyed by file and names, never by line numbers.
"""

from __future__ import annotations

import ast
import builtins
import functools
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

Function = ast.FunctionDef | ast.AsyncFunctionDef

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "checkpointless"
EXEMPT_FROM_WIRING = ("checkpointless/integrations/",)
"""An integration patches the host library's own objects (its privates pinned by a test)."""
EXEMPT_FROM_WRITES = ("checkpointless/_compat.py",)
"""Every private torch name, gated by version (STYLE.md 18): what it writes is torch's."""

ALLOWED: dict[tuple[str, str], str] = {
    (
        "checkpointless/integrations/transformers.py",
        "Seq2SeqTrainer(Trainer)",
    ): "mirrors transformers' own hierarchy (Seq2SeqTrainer is a Trainer there too)",
}
"""Inheritance between package classes that is a real "is a": (file, ``Class(Base)``) -> why."""


# ----------------------------------------------------------------------------- the analysis


@dataclass
class ClassInfo:
    module: Module
    node: ast.ClassDef
    bases: list[str] = field(default_factory=list)
    """Each base's qualified name (``checkpointless.x.Y``, ``torch.nn.Module``, ``builtins.ValueError``)."""
    writes: set[str] = field(default_factory=set)
    """Attributes it writes on ``self`` (or declares in its body)."""
    methods: set[str] = field(default_factory=set)
    """Its methods (not properties)."""
    properties: set[str] = field(default_factory=set)
    types: dict[str, str] = field(default_factory=dict)
    """Attribute -> the qualified name of the class it is built from (``self.x = X(...)``)."""
    annotations: dict[str, ast.expr] = field(default_factory=dict)
    """Attribute -> its annotation where the class says it: a field, ``self.x: T = ...``, or
    ``self.x = p`` for a parameter ``p: T`` of the method."""
    functions: dict[str, Function] = field(default_factory=dict)
    """Its methods and properties by name (their return annotations type what they give)."""

    @property
    def frozen(self) -> bool:
        """Its instances cannot be written: a frozen dataclass or a ``NamedTuple``."""
        if "typing.NamedTuple" in self.bases:
            return True
        return any(
            isinstance(d, ast.Call)
            and self.module.resolve(d.func) == "dataclasses.dataclass"
            and any(
                k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in d.keywords
            )
            for d in self.node.decorator_list
        )

    def init_parameters(self) -> dict[str, ast.expr | None]:
        """Its constructor's parameters (``__init__``'s, else a dataclass's fields) and their annotations."""
        init = self.functions.get("__init__")
        if init is None:
            return dict(self.annotations) if _is_dataclass(self) else {}
        args = [*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs][1:]
        return {a.arg: a.annotation for a in args}

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def file(self) -> str:
        return self.module.file


@dataclass
class Module:
    name: str
    file: str
    tree: ast.Module
    is_package: bool
    names: dict[str, str] = field(default_factory=dict)
    """Local name -> qualified name, for every import in the module."""
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)
    """Its top-level functions."""

    @functools.cached_property
    def scope(self) -> Scope:
        """Its own statements, as a function's."""
        return next(s for s in _functions(self.tree) if s.name == "<module>")

    def resolve(self, expr: ast.expr) -> str | None:
        """The qualified name ``expr`` refers to, through this module's imports and definitions."""
        if isinstance(expr, ast.Subscript):  # Generic[T], Dataset[Any], Protocol[T]
            return self.resolve(expr.value)
        if isinstance(expr, ast.Attribute):
            head = self.resolve(expr.value)
            return None if head is None else f"{head}.{expr.attr}"
        if isinstance(expr, ast.Name):
            if expr.id in self.classes or expr.id in self.functions:
                return f"{self.name}.{expr.id}"
            if expr.id in self.names:
                return self.names[expr.id]
            if hasattr(builtins, expr.id):
                return f"builtins.{expr.id}"
        return None


def _module_name(file: str) -> tuple[str, bool]:
    parts = list(Path(file).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported(module: Module, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str]]:
    """(local name, qualified name) for each name an import statement binds."""
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                yield a.asname, a.name
            else:
                head = a.name.split(".")[0]
                yield head, head
        return
    if node.level:
        base = module.name.split(".")
        if not module.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    for a in node.names:
        if a.name != "*":
            yield a.asname or a.name, f"{source}.{a.name}"


def _first_arg(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    args = [*fn.args.posonlyargs, *fn.args.args]
    decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
    if not args or "staticmethod" in decorators:
        return None
    return args[0].arg


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """Every expression assigned to by an assignment statement (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        stack = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign) and (
        not isinstance(node, ast.AnnAssign) or node.value is not None
    ):
        stack = [node.target]
    else:
        return
    while stack:
        t = stack.pop()
        if isinstance(t, ast.Tuple | ast.List):
            stack.extend(t.elts)
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        else:
            yield t


class Package:
    """Every module of a package, parsed: ``sources`` maps a file path relative to the repository
    (``checkpointless/x.py``) to its text."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.modules: dict[str, Module] = {}
        self._ancestors: dict[tuple[str, str], list[ClassInfo]] = {}
        for file, text in sorted(sources.items()):
            name, is_package = _module_name(file)
            self.modules[name] = Module(name, file, ast.parse(text, file), is_package)
        for module in self.modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    module.names.update(_imported(module, node))
            for node in module.tree.body:
                if isinstance(node, ast.ClassDef):
                    module.classes[node.name] = ClassInfo(module, node)
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    module.functions[node.name] = node
        for module in self.modules.values():
            for info in module.classes.values():
                self._read_class(info)

    @classmethod
    def from_disk(cls, root: Path = ROOT) -> Package:
        files = sorted((root / PACKAGE).rglob("*.py"))
        return cls({p.relative_to(root).as_posix(): p.read_text() for p in files})

    def _read_class(self, info: ClassInfo) -> None:
        info.bases = [q for b in info.node.bases if (q := info.module.resolve(b)) is not None]
        for node in info.node.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _is_property(node):
                    info.properties.add(node.name)
                else:
                    info.methods.add(node.name)
                info.functions.setdefault(node.name, node)
                me = _first_arg(node)
                params = {
                    a.arg: a.annotation
                    for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                    if a.annotation is not None
                }
                for sub in ast.walk(node):
                    for t in _targets(sub):
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == me
                        ):
                            info.writes.add(t.attr)
                            value = getattr(sub, "value", None)
                            if isinstance(value, ast.Call) and (q := info.module.resolve(value.func)):
                                info.types.setdefault(t.attr, q)
                            if isinstance(sub, ast.AnnAssign):
                                info.annotations.setdefault(t.attr, sub.annotation)
                            elif isinstance(value, ast.Name) and value.id in params:
                                info.annotations.setdefault(t.attr, params[value.id])
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                info.writes.add(node.target.id)
                info.annotations.setdefault(node.target.id, node.annotation)
            elif isinstance(node, ast.Assign):
                info.writes.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def find(self, qualified: str, seen: frozenset[str] = frozenset()) -> ClassInfo | None:
        """The package class ``qualified`` names (following re-exports), or None."""
        if qualified in seen:
            return None
        parts = qualified.split(".")
        for i in range(len(parts) - 1, 0, -1):
            module = self.modules.get(".".join(parts[:i]))
            if module is None:
                continue
            if i != len(parts) - 1:
                return None
            name = parts[-1]
            if name in module.classes:
                return module.classes[name]
            if name in module.names:
                return self.find(module.names[name], seen | {qualified})
            return None
        return None

    def classes(self) -> Iterator[ClassInfo]:
        for module in self.modules.values():
            yield from module.classes.values()

    def ancestors(self, info: ClassInfo) -> list[ClassInfo]:
        """The package classes above ``info``, nearest first (breadth first)."""
        key = (info.module.name, info.name)
        if key not in self._ancestors:
            self._ancestors[key] = self._find_ancestors(info)
        return self._ancestors[key]

    def _find_ancestors(self, info: ClassInfo) -> list[ClassInfo]:
        out: list[ClassInfo] = []
        queue = [info]
        while queue:
            current = queue.pop(0)
            for base in current.bases:
                found = self.find(base)
                if found is not None and found is not info and found not in out:
                    out.append(found)
                    queue.append(found)
        return out

    def is_exception(self, qualified: str, seen: frozenset[str] = frozenset()) -> bool:
        if qualified.startswith("builtins."):
            obj = getattr(builtins, qualified.removeprefix("builtins."), None)
            return isinstance(obj, type) and issubclass(obj, BaseException)
        found = self.find(qualified)
        if found is None:  # outside the package: its name says it (yaml.YAMLError, ...)
            return qualified.endswith(("Error", "Exception", "Warning", "Exit", "Interrupt"))
        if qualified in seen:
            return False
        return any(self.is_exception(b, seen | {qualified}) for b in found.bases)

    # ------------------------------------------------------------------------- the rules

    def inheritance(self) -> Iterator[tuple[str, str, str]]:
        """(file, ``Class(Base)``, detail) for each package base that is not an "is a"."""
        for info in self.classes():
            for base in info.bases:
                found = self.find(base)
                if found is None or self.is_exception(base):
                    continue
                if any(b in ("typing.Protocol", "typing_extensions.Protocol") for b in found.bases):
                    continue
                if _plain_dataclass(found):
                    continue
                if (info.file, f"{info.name}({found.name})") in ALLOWED:
                    continue
                yield info.file, f"{info.name}({found.name})", f"{found.name} is in {found.file}"

    def wiring(self) -> Iterator[tuple[str, str, str]]:
        """(file, ``where: target = kind``, detail) for each collaborator wired after construction."""
        for module in self.modules.values():
            if module.file.startswith(EXEMPT_FROM_WIRING):
                continue
            for scope in _functions(module.tree):
                me = scope.me
                owner = None if scope.cls is None else module.classes.get(scope.cls)
                nodes = _own_statements(scope.fn)
                local_defs = {n.name for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                for node in nodes:
                    for target, value in _assigned(node):
                        if not isinstance(target, ast.Attribute):
                            continue
                        if isinstance(target.value, ast.Name) and target.value.id == me:
                            continue  # self.x = ...: its own attribute
                        kind = self._callable_kind(value, local_defs, owner, me)
                        if kind is None:
                            kind = self._collaborator(module, scope, target)
                        if kind is not None:
                            yield module.file, f"{scope.name}: {ast.unparse(target)} = {kind}", ""

    def _methods_of(self, info: ClassInfo) -> set[str]:
        return {m for c in [info, *self.ancestors(info)] for m in c.methods}

    def _callable_kind(
        self, value: ast.expr, local_defs: set[str], owner: ClassInfo | None, me: str | None
    ) -> str | None:
        """``lambda``, ``local function f``, ``bound method x.m`` when ``value`` is such a callable."""
        if isinstance(value, ast.Lambda):
            return "lambda"
        if isinstance(value, ast.Name) and value.id in local_defs:
            return f"local function {value.id}"
        if (
            isinstance(value, ast.Call)
            and value.args
            and ast.unparse(value.func) in ("partial", "functools.partial")
        ):
            inner = self._callable_kind(value.args[0], local_defs, owner, me)
            return None if inner is None else f"partial of {inner}"
        if not isinstance(value, ast.Attribute):
            return None
        obj = value.value
        built = None
        if (
            owner is not None
            and isinstance(obj, ast.Attribute)
            and isinstance(obj.value, ast.Name)
            and obj.value.id == me
        ):  # self.part.m, where self.part = Part(...)
            built = self._type_of(owner, obj.attr)
        if owner is not None and isinstance(obj, ast.Name) and obj.id == me:  # self.m
            is_method = value.attr in self._methods_of(owner)
        elif built is not None:
            is_method = value.attr in self._methods_of(built)
        else:  # an object of a class not known here: a name that is a method somewhere, never data
            is_method = value.attr in self._method_names and value.attr not in self._data_names
        return f"bound method {ast.unparse(value)}" if is_method else None

    def _collaborator(self, module: Module, scope: Scope, target: ast.Attribute) -> str | None:
        """``Class(x=...)`` when ``target`` (``obj.x``) is a collaborator that the class of ``obj``
        takes in its constructor, whatever the value assigned."""
        kind = self.type_of(module, scope, target.value)
        found = None if kind is None else self.find(kind)
        for c in [] if found is None else [found, *self.ancestors(found)]:
            params = c.init_parameters()
            if target.attr in params and self._is_collaborator(c.module, params[target.attr]):
                return f"{c.name}({target.attr}=...)"
        return None

    def _is_collaborator(self, module: Module, ann: ast.expr | None) -> bool:
        """Whether an annotation names a collaborator: a callable, an object of a package class that
        is not a value (a dataclass, an enum, an exception), or a list or an optional of them."""
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            ann = ast.parse(ann.value, mode="eval").body
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
            return self._is_collaborator(module, ann.left) or self._is_collaborator(module, ann.right)
        if isinstance(ann, ast.Subscript):
            q = module.resolve(ann.value)
            if q in CALLABLE:
                return True
            if q in ("typing.Optional", *SEQUENCES):
                inner = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
                return any(self._is_collaborator(module, x) for x in inner)
            return False
        q = None if ann is None else module.resolve(ann)
        if q is None or q in CALLABLE:
            return q is not None
        found = self.find(q)
        return found is not None and not self._is_value(found)

    def _is_value(self, info: ClassInfo) -> bool:
        """A class whose objects are values, not collaborators: a dataclass, a ``NamedTuple``, an
        enum, an exception."""
        chain = [info, *self.ancestors(info)]
        bases = {b for c in chain for b in c.bases}
        return (
            any(_is_dataclass(c) or c.frozen for c in chain)
            or any(b.startswith("enum.") for b in bases)
            or any(self.is_exception(b) for b in info.bases)
        )

    def _type_of(self, info: ClassInfo, attr: str) -> ClassInfo | None:
        for c in [info, *self.ancestors(info)]:
            if attr in c.types:
                return self.find(c.types[attr])
        return None

    @functools.cached_property
    def _method_names(self) -> set[str]:
        return {m for info in self.classes() for m in info.methods}

    @functools.cached_property
    def _data_names(self) -> set[str]:
        return {a for info in self.classes() for a in (*info.writes, *info.properties)}

    def attribute_writes(self) -> Iterator[tuple[str, str, str]]:
        """(file, ``Owner.x``, detail) for each attribute written outside its owner's file."""
        for info in self.classes():
            chain = [info, *self.ancestors(info)]
            for attr in sorted(info.writes):
                owner = [c for c in chain if attr in c.writes][-1]
                if owner.file != info.file:
                    yield info.file, f"{owner.name}.{attr}", f"written by {info.name}, owned in {owner.file}"
        for module in self.modules.values():
            if module.file in EXEMPT_FROM_WRITES:
                continue
            for scope, target in _foreign_writes(module):
                owners = self._owners(module, scope, target)
                if owners and all(o.file != module.file for o in owners):
                    names = "|".join(sorted({o.name for o in owners}))
                    yield module.file, f"{names}.{target.attr}", f"{scope.name} writes {ast.unparse(target)}"

    def _owners(self, module: Module, scope: Scope, target: ast.Attribute) -> list[ClassInfo]:
        """The package classes that own the attribute ``target`` writes (none: not a package
        object's, or one that cannot be written)."""
        attr = target.attr
        kind = self.type_of(module, scope, target.value)
        if kind is not None and not kind.startswith(f"{PACKAGE}."):
            return []  # another library's object
        found = None if kind is None else self.find(kind)
        if found is not None:
            chain = [found, *self.ancestors(found)]
            writers = [c for c in chain if attr in c.writes]
            if writers:
                return [] if writers[-1].frozen else [writers[-1]]
            if any(attr in c.properties for c in chain):
                return []  # its setter: the class's own method
        # an object of unknown type: the roots of the classes that write an attribute of that name
        declared = [c for c in self._writers.get(attr, []) if not c.frozen]
        if any(c.file == module.file for c in declared):
            return []
        return [c for c in declared if not any(attr in a.writes for a in self.ancestors(c))]

    @functools.cached_property
    def _writers(self) -> dict[str, list[ClassInfo]]:
        out: dict[str, list[ClassInfo]] = {}
        for info in self.classes():
            for attr in info.writes:
                out.setdefault(attr, []).append(info)
        return out

    # ------------------------------------------------------------------------- the types of values

    def type_of(self, module: Module, scope: Scope, expr: ast.expr, depth: int = 0) -> str | None:
        """The qualified name of the class of ``expr``'s value in ``scope``, where the source says
        it; a name outside the package for another library's object (a function or a module of
        it included); None when it is not known (a container, ``Any``, a value pulled out of one)."""
        if depth > 8:
            return None
        if isinstance(expr, ast.Name):
            return self._type_of_name(module, scope, expr.id, depth)
        if isinstance(expr, ast.Call):
            return self._type_of_call(module, scope, expr, depth)
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id in module.names:
                return _known(module.resolve(expr))  # torch.nn.Module, threading.local, ...
            of = self.type_of(module, scope, expr.value, depth + 1)
            if of is None or not of.startswith(f"{PACKAGE}."):
                return None if of is None else f"{of}.{expr.attr}"
            found = self.find(of)
            for c in [] if found is None else [found, *self.ancestors(found)]:
                if expr.attr in c.types:
                    return _known(c.types[expr.attr])
                if expr.attr in c.annotations:
                    return self._annotated(c.module, c.annotations[expr.attr])
                if expr.attr in c.properties:
                    return self._annotated(c.module, c.functions[expr.attr].returns)
        return None

    def _type_of_name(self, module: Module, scope: Scope, name: str, depth: int) -> str | None:
        if name == scope.me and scope.cls is not None:
            return f"{module.name}.{scope.cls}"
        fn = scope.fn
        params = {a.arg: a.annotation for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        bound = _bindings(fn).get(name)
        if name not in params and bound is None:
            if ".<locals>." in scope.name or scope.name == "<module>":
                return None  # a closure's (not followed), or a name bound nowhere here
            if name in module.names:
                return _known(module.names[name])
            if name in module.classes:
                return f"{module.name}.{name}"
            return self._type_of_name(module, module.scope, name, depth + 1)
        found: set[str | None] = set()
        if name in params:
            found.add(self._annotated(module, params[name]))
        for how, expr in bound or []:
            if how == "value":
                found.add(self.type_of(module, scope, expr, depth + 1))
            elif how == "annotation":
                found.add(self._annotated(module, expr))
            elif how == "import":
                found.add(_known(module.names.get(name)))
            elif how == "iterated":  # for x in <another library's object>: its items are its too
                of = self.type_of(module, scope, expr, depth + 1)
                found.add(None if of is None or of.startswith(f"{PACKAGE}.") else f"{of}[]")
            else:
                found.add(None)
        return found.pop() if len(found) == 1 else None

    def _type_of_call(self, module: Module, scope: Scope, call: ast.Call, depth: int) -> str | None:
        func = call.func
        fn = scope.fn
        if isinstance(func, ast.Name):  # a parameter ``f: Callable[..., T]``
            for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
                if a.arg == func.id:
                    return self._returned_by(module, a.annotation)
        head = func
        while isinstance(head, ast.Attribute):
            head = head.value
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        local = isinstance(head, ast.Name) and (
            head.id == scope.me
            or head.id in params
            or any(how != "import" for how, _ in _bindings(fn).get(head.id, []))
        )
        q = None if local else module.resolve(func)  # a class, a function, an import's callable
        if q is not None:
            if self.find(q) is not None:
                return q  # a package class: its constructor
            if (f := self.find_function(q)) is not None:
                return self._annotated(f[0], f[1].returns)
            return _known(q)  # another library's callable gives another library's object
        if isinstance(func, ast.Attribute):  # a method
            of = self.type_of(module, scope, func.value, depth + 1)
            if of is None:
                return None
            if not of.startswith(f"{PACKAGE}."):
                return f"{of}.{func.attr}()"
            found = self.find(of)
            for c in [] if found is None else [found, *self.ancestors(found)]:
                if func.attr in c.functions:
                    return self._annotated(c.module, c.functions[func.attr].returns)
        return None

    def _annotated(self, module: Module, ann: ast.expr | None) -> str | None:
        """The class an annotation names (``X | None`` is ``X``; a container, ``Any``: None)."""
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            ann = ast.parse(ann.value, mode="eval").body
        if isinstance(ann, ast.BinOp):
            return self._annotated(module, _optional(ann))
        if isinstance(ann, ast.Subscript) and module.resolve(ann.value) == "typing.Optional":
            return self._annotated(module, ann.slice)
        return None if ann is None else _known(module.resolve(ann))

    def _returned_by(self, module: Module, ann: ast.expr | None) -> str | None:
        """What a callable annotated ``Callable[[...], T]`` returns: ``T``'s class."""
        if isinstance(ann, ast.BinOp):
            ann = _optional(ann)
        if (
            isinstance(ann, ast.Subscript)
            and module.resolve(ann.value) in ("typing.Callable", "collections.abc.Callable")
            and isinstance(ann.slice, ast.Tuple)
            and len(ann.slice.elts) == 2
        ):
            return self._annotated(module, ann.slice.elts[1])
        return None

    def find_function(
        self, qualified: str, seen: frozenset[str] = frozenset()
    ) -> tuple[Module, Function] | None:
        """The package's top-level function ``qualified`` names (following re-exports), or None."""
        head, _, name = qualified.rpartition(".")
        module = self.modules.get(head)
        if module is None or qualified in seen:
            return None
        if name in module.functions:
            return module, module.functions[name]
        if name in module.names:
            return self.find_function(module.names[name], seen | {qualified})
        return None


def _is_property(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        text = ast.unparse(d)
        if text in ("property", "cached_property", "functools.cached_property"):
            return True
        if text.endswith((".setter", ".deleter")):
            return True
    return False


def _is_dataclass(info: ClassInfo) -> bool:
    return any(
        info.module.resolve(d.func if isinstance(d, ast.Call) else d) == "dataclasses.dataclass"
        for d in info.node.decorator_list
    )


def _plain_dataclass(info: ClassInfo) -> bool:
    """A dataclass whose body defines no method (nor property)."""
    return _is_dataclass(info) and not info.methods and not info.properties


CALLABLE = ("typing.Callable", "collections.abc.Callable")
SEQUENCES = ("builtins.list", "builtins.tuple", "typing.Sequence", "collections.abc.Sequence", "typing.List")

GENERIC = ("builtins", "typing", "typing_extensions", "collections", "copy", "dataclasses", "functools",
           "itertools", "contextlib", "queue", "weakref", "operator", "heapq")  # fmt: skip
"""Modules whose types hold or pass on any object (a container, ``Any``, ``copy.copy``): what they
give is of no known type."""


def _optional(ann: ast.BinOp) -> ast.expr | None:
    """``X`` of ``X | None`` (None for any other union)."""
    parts = [x for x in (ann.left, ann.right) if not (isinstance(x, ast.Constant) and x.value is None)]
    return parts[0] if isinstance(ann.op, ast.BitOr) and len(parts) == 1 else None


def _known(qualified: str | None) -> str | None:
    return None if qualified is None or qualified.split(".")[0] in GENERIC else qualified


@functools.cache
def _bindings(fn: Function) -> dict[str, list[tuple[str, ast.expr | None]]]:
    """Each name ``fn``'s own statements bind -> how: (``value``, the value assigned), (``annotation``,
    its annotation), (``iterated``, what a ``for`` loop iterates), (``import``, None), or (``other``,
    None): a tuple unpacked, ``with ... as``, ``except ... as``."""
    out: dict[str, list[tuple[str, ast.expr | None]]] = {}
    for node in _own_statements(fn):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and isinstance(node, ast.AnnAssign):
                    out.setdefault(t.id, []).append(("annotation", node.annotation))
                elif isinstance(t, ast.Name) and isinstance(node, ast.Assign | ast.NamedExpr):
                    out.setdefault(t.id, []).append(("value", node.value))
                else:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                            out.setdefault(n.id, []).append(("other", None))
        elif isinstance(node, ast.For | ast.AsyncFor):
            if isinstance(node.target, ast.Name):
                out.setdefault(node.target.id, []).append(("iterated", node.iter))
            else:
                for n in ast.walk(node.target):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        out.setdefault(n.id, []).append(("other", None))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            for n in ast.walk(node.optional_vars):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    out.setdefault(n.id, []).append(("other", None))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.setdefault(node.name, []).append(("other", None))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                out.setdefault((a.asname or a.name).split(".")[0], []).append(("import", None))
    return out


@dataclass
class Scope:
    name: str
    """``Class.method``, ``f.<locals>.g``, or ``<module>`` for the module's own statements."""
    fn: Function
    cls: str | None
    """The class whose method this is (or encloses it)."""
    me: str | None
    """The name ``self`` has here (a nested function sees its method's)."""


def _functions(tree: ast.Module) -> Iterator[Scope]:
    """Every function and method, and the module's own statements."""

    def visit(
        body: Iterable[ast.stmt], prefix: str, cls: str | None, me: str | None, in_class: bool
    ) -> Iterator[Scope]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from visit(
                    node.body, f"{prefix}{node.name}.", node.name if cls is None else cls, None, True
                )
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                mine = _first_arg(node) if in_class else me
                yield Scope(f"{prefix}{node.name}", node, cls, mine)
                yield from visit(node.body, f"{prefix}{node.name}.<locals>.", cls, mine, False)
            else:
                inner = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
                yield from visit(inner, prefix, cls, me, in_class)

    yield from visit(tree.body, "", None, None, False)
    top = [s for s in tree.body if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    fn = ast.FunctionDef(name="<module>", args=args, body=top, decorator_list=[])
    yield Scope("<module>", fn, None, None)


def _own_statements(fn: Function) -> list[ast.AST]:
    """The nodes of ``fn``'s body; nested functions, classes and lambdas are listed, not entered."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))
    return out


def _assigned(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of an assignment statement or a ``setattr(obj, name, value)`` call."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [(node.target, node.value)]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) == 3
    ):
        name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "<name>"
        return [(ast.Attribute(value=node.args[0], attr=str(name)), node.args[2])]
    return []


def _foreign_writes(module: Module) -> Iterator[tuple[Scope, ast.Attribute]]:
    """Attribute writes ``obj.x = ...`` whose object is not the enclosing method's ``self``."""
    for scope in _functions(module.tree):
        for node in _own_statements(scope.fn):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and not (
                    isinstance(t.value, ast.Name) and t.value.id == scope.me
                ):
                    yield scope, t


# ----------------------------------------------------------------------------- the ratchet

KNOWN: dict[tuple[str, str, str], str] = {
    # (rule, file, names) -> why it is still there. The list may only shrink (it is empty: keep it so).
}  # fmt: skip


RULES = {
    "inherit": Package.inheritance,
    "wiring": Package.wiring,
    "attributes": Package.attribute_writes,
}


def violations(package: Package, rule: str) -> dict[tuple[str, str, str], str]:
    return {(rule, file, what): detail for file, what, detail in RULES[rule](package)}


def ratchet(
    rule: str, found: dict[tuple[str, ...], str], known: Iterable[tuple[str, ...]], where: str
) -> str:
    """What is wrong between the violations ``found`` and the ``known`` ones ('' when nothing):
    a violation not known, or a known one that is gone (the list only shrinks)."""
    known = set(known)
    new = sorted(set(found) - known)
    gone = sorted(known - set(found))
    lines = []
    if new:
        lines.append(
            f"new {rule} violation(s): fix them (or, as a stated decision, list them in {where} with a reason):"
        )
        lines += [f"  {k!r}: {found[k]}" if found[k] else f"  {k!r}" for k in new]
    if gone:
        lines.append(
            f"no longer {rule} violation(s): delete these entries from {where} (the list only shrinks):"
        )
        lines += [f"  {k!r}" for k in gone]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def package() -> Package:
    return Package.from_disk()


@pytest.mark.parametrize("rule", list(RULES))
def test_the_known_violations_only_shrink(package: Package, rule: str) -> None:
    known = [k for k in KNOWN if k[0] == rule]
    problems = ratchet(rule, violations(package, rule), known, "tests/unit/test_structure.py KNOWN")
    if problems:
        pytest.fail(problems, pytrace=False)


def test_the_allow_list_names_inheritance_that_exists(package: Package) -> None:
    here = {
        (c.file, f"{c.name}({b.name})") for c in package.classes() for b in map(package.find, c.bases) if b
    }
    assert set(ALLOWED) <= here, f"ALLOWED names inheritance that no longer exists: {set(ALLOWED) - here}"


def test_every_known_entry_has_a_reason() -> None:
    assert all(rule in RULES and why.strip() for (rule, _, _), why in KNOWN.items())


# ----------------------------------------------------------------------------- the rules can fail


def _crafted(sources: dict[str, str]) -> Package:
    return Package({f: textwrap.dedent(t) for f, t in sources.items()})


BASE = """
    from dataclasses import dataclass
    from typing import Protocol


    class Base:
        def __init__(self) -> None:
            self._x = 0
            self.count = 0

        def work(self) -> None:
            self._y = 1

        @property
        def size(self) -> int:
            return 1


    class Err(ValueError):
        pass


    @dataclass
    class Plain:
        x: int = 0


    @dataclass
    class WithMethod:
        x: int = 0

        def f(self) -> int:
            return self.x


    class Proto(Protocol):
        def f(self) -> None: ...
"""


def test_inheritance_is_resolved_through_imports_and_flagged() -> None:
    package = _crafted({
        "checkpointless/__init__.py": "from checkpointless.base import Base as Reexported\n",
        "checkpointless/base.py": BASE,
        "checkpointless/sub/__init__.py": "",
        "checkpointless/sub/a.py": """
            import threading

            import checkpointless.base as b
            from checkpointless import Reexported
            from checkpointless.base import Base, Err
            from torch import nn

            from ..base import Plain


            class Local:
                def f(self) -> None: ...


            class A(Base): ...
            class B(b.WithMethod): ...
            class C(Err): ...
            class D(Plain): ...
            class E(b.Proto): ...
            class F(nn.Module): ...
            class G(threading.Thread): ...
            class H(Local): ...
            class I(C): ...
            class J(Reexported): ...
            class K(Exception): ...
            class L(K): ...
        """,
    })  # fmt: skip
    found = {what for _, what, _ in package.inheritance()}
    assert found == {"A(Base)", "B(WithMethod)", "H(Local)", "J(Base)"}


def test_wiring_after_construction_is_flagged() -> None:
    package = _crafted({
        "checkpointless/base.py": BASE,
        "checkpointless/wire.py": """
            import functools

            from checkpointless.base import Base


            class Hub:
                def __init__(self, other: Base) -> None:
                    self.part = Base()
                    self.other = other
                    self.cb = lambda: None           # its own attribute: fine
                    self.other.cb = lambda: None     # flagged
                    other.size_of = self.part.size   # a property's value: fine
                    other.n = self.part.count        # data: fine
                    other.go = self.part.work        # flagged: a bound method
                    other.go2 = self.tick            # flagged: its own bound method onto another
                    other.go3 = functools.partial(self.tick, 1)  # flagged

                    def local() -> None: ...

                    other.local = local              # flagged
                    setattr(other, "late", lambda: None)  # flagged

                    def closure(peer: Base) -> None:
                        self.cb = lambda: None       # the method's self: fine
                        peer.cb = self.tick          # flagged

                    self.closure = closure

                def tick(self, n: int = 0) -> None: ...


            def build(hub: Hub, x: Base) -> None:
                x.after = hub.tick                   # flagged: tick is a method, never data
        """,
        "checkpointless/integrations/host.py": """
            def patch(trainer, replay) -> None:
                trainer.prediction_step = replay.prediction_step
                trainer.hook = lambda: None
        """,
    })  # fmt: skip
    found = {what for _, what, _ in package.wiring()}
    assert found == {
        "Hub.__init__: self.other.cb = lambda",
        "Hub.__init__: other.go = bound method self.part.work",
        "Hub.__init__: other.go2 = bound method self.tick",
        "Hub.__init__: other.go3 = partial of bound method self.tick",
        "Hub.__init__: other.local = local function local",
        "Hub.__init__: other.late = lambda",
        "Hub.__init__.<locals>.closure: peer.cb = bound method self.tick",
        "build: x.after = bound method hub.tick",
    }


def test_attributes_written_outside_their_owners_file_are_flagged() -> None:
    package = _crafted({
        "checkpointless/base.py": BASE,
        "checkpointless/things.py": """
            from dataclasses import dataclass

            from checkpointless.base import Base


            @dataclass(frozen=True)
            class Record:
                x: int


            def make() -> Base:
                return Base()
        """,
        "checkpointless/tower.py": """
            from checkpointless.base import Base


            class Sub(Base):
                def step(self) -> None:
                    self._x = 2          # flagged: Base owns _x
                    self._own = 3        # its own
                    self.count = 4       # flagged: Base owns count (public or not)


            def poke(obj, opts) -> None:
                obj._y = 5               # flagged: only Base writes _y
                opts._timeout = 1        # no package class has it: the host library's own
        """,
        "checkpointless/base_helpers.py": """
            def same_name_elsewhere(obj) -> None:
                obj._own = 1             # flagged: Sub owns _own (in tower.py)
        """,
        "checkpointless/users.py": """
            import argparse
            import threading

            from torch import nn

            from checkpointless.base import Base, Plain
            from checkpointless.things import Record, make

            _local = threading.local()


            class Mine:
                def __init__(self, part: Base) -> None:
                    self.count = 0
                    self.part = part
                    self.built = Base()

                def go(self, base: Base, other) -> None:
                    base.count = 1           # flagged: typed Base's (though Mine has a count too)
                    self.part.count = 2      # flagged: given as a Base
                    self.built.count = 3     # flagged: built as Base()
                    other.count = 4          # an unknown type, and Mine (this file) writes a count
                    plain = Plain(x=1)       # a constructor's argument: fine
                    plain.x = 2              # flagged: Plain's field
                    record = Record(x=1)
                    record.x = 2             # a frozen record: it cannot be written (it raises)
                    made = make()
                    made.count = 5           # flagged: make() gives a Base


            def cli(parser: argparse.ArgumentParser, model: nn.Module) -> None:
                args = parser.parse_args([])
                args.count = 1               # another library's objects from here on
                for p in model.parameters():
                    p.x = 2
                _local.count = 3
        """,
    })  # fmt: skip
    found = {(f, what, detail) for f, what, detail in package.attribute_writes()}
    assert found == {
        ("checkpointless/tower.py", "Base._x", "written by Sub, owned in checkpointless/base.py"),
        ("checkpointless/tower.py", "Base.count", "written by Sub, owned in checkpointless/base.py"),
        ("checkpointless/tower.py", "Base._y", "poke writes obj._y"),
        ("checkpointless/base_helpers.py", "Sub._own", "same_name_elsewhere writes obj._own"),
        ("checkpointless/users.py", "Base.count", "Mine.go writes base.count"),
        ("checkpointless/users.py", "Base.count", "Mine.go writes self.part.count"),
        ("checkpointless/users.py", "Base.count", "Mine.go writes self.built.count"),
        ("checkpointless/users.py", "Base.count", "Mine.go writes made.count"),
        ("checkpointless/users.py", "Plain.x", "Mine.go writes plain.x"),
    }


def test_a_collaborator_set_after_construction_is_flagged_whatever_its_value() -> None:
    package = _crafted({
        "checkpointless/base.py": BASE,
        "checkpointless/runner.py": """
            from collections.abc import Callable
            from dataclasses import dataclass
            from enum import Enum

            from checkpointless.base import Base


            class Kind(Enum):
                A = 1


            @dataclass
            class View:
                kind: Kind
                n: int = 0


            class Runner:
                def __init__(
                    self,
                    part: Base,
                    on_tick: Callable[[], None] | list[Callable[[], None]] | None = None,
                    every: float = 1.0,
                    view: View | None = None,
                ) -> None:
                    self.on_tick = on_tick
                    self.part = part
                    self.every = every
                    self.view = view


            def run(runner: Runner, callbacks: list, view: View) -> None:
                runner.on_tick = callbacks   # flagged: a callback its constructor takes
                runner.part = Base()         # flagged: a collaborator its constructor takes
                runner.every = 2.0           # data
                runner.view = view           # a value (a dataclass)
                view.kind = Kind.A           # a value (an enum)
                view.n = 1
        """,
    })  # fmt: skip
    found = {what for _, what, _ in package.wiring()}
    assert found == {"run: runner.on_tick = Runner(on_tick=...)", "run: runner.part = Runner(part=...)"}


def test_the_ratchet_fails_both_ways() -> None:
    found = {("wiring", "a.py", "X.f: y.z = lambda"): "", ("wiring", "a.py", "kept"): ""}
    assert ratchet("wiring", found, found, "KNOWN") == ""
    grown = ratchet("wiring", found, [("wiring", "a.py", "kept")], "KNOWN")
    assert "new wiring violation" in grown and "y.z = lambda" in grown
    shrunk = ratchet("wiring", {("wiring", "a.py", "kept"): ""}, found, "KNOWN")
    assert "delete these entries" in shrunk and "y.z = lambda" in shrunk
