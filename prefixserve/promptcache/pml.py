"""The Prompt Markup Language (Prompt Cache, section 3.2): schemas of reusable modules, and prompts.

A schema names modules (``<module name>``), unions of mutually exclusive modules (``<union>``),
parameters (``<param name len>``; ``<parameter>`` and ``length`` are accepted too), role tags
(``<system>``, ``<user>``, ``<assistant>``) and anonymous text, which every prompt of the schema
includes. A prompt (``<prompt schema="...">``) imports modules as empty elements whose attributes are
the module's arguments (``<trip-plan duration="3 days"/>``), nested imports inside their parent, and
free text. Importing a nested module brings its enclosing modules along.

Parsing goes through defusedxml (no DTDs, no entity expansion, no external references) with size,
attribute and depth limits checked before anything is built; every error names line, column and
problem. Pure Python: no torch, no tokenizer (``layout`` assigns positions to tokenized text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from xml.etree.ElementTree import Element, TreeBuilder

MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
MAX_ATTRIBUTE_CHARS = 64 * 1024
MAX_DEPTH = 64
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_PROMPT_START = re.compile(r"\s*<prompt[\s/>]")


def is_pml_prompt(text: str) -> bool:
    """Is ``text`` a ``<prompt ...>`` document? Such text always goes to Prompt Cache (an unknown
    schema is refused by name), so a chat message or completion prompt is never half-read as XML."""
    return _PROMPT_START.match(text) is not None


class PMLError(ValueError):
    """A PML document that cannot be used; the message names line, column and problem."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(f"PML {where}{problem}")
        self.line, self.column, self.problem = line, column, problem

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole: the engine process sends it to the server
        return (PMLError, (self.problem, self.line, self.column))


# ---- the document model ----------------------------------------------------------------------
@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class Param:
    name: str
    length: int  # placeholder positions reserved for the argument (tokens)
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class Role:
    role: str  # system | user | assistant: rendered through the model's chat template
    children: list[Node] = field(default_factory=list)


@dataclass(slots=True)
class Module:
    name: str
    children: list[Node] = field(default_factory=list)
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class Union:
    members: list[Module] = field(default_factory=list)
    line: int = 0
    column: int = 0


Node = Text | Param | Role | Module | Union


@dataclass(slots=True)
class Schema:
    name: str
    children: list[Node]
    modules: dict[str, Module]  # every module by name, nested ones included
    parent: dict[str, str | None]  # module -> enclosing module (None at top level)
    union_of: dict[str, int]  # module -> id of the union it belongs to, if any

    @property
    def has_roles(self) -> bool:
        """Does the schema hold role tags (a chat-shaped schema: prompts then end as chats do)?"""
        stack: list[Node] = list(self.children)
        while stack:
            node = stack.pop()
            if isinstance(node, Role):
                return True
            if isinstance(node, Module):
                stack.extend(node.children)
            elif isinstance(node, Union):
                stack.extend(node.members)
        return False

    def ancestors(self, name: str) -> list[str]:
        """The enclosing modules of ``name``, outermost first."""
        out = []
        up = self.parent[name]
        while up is not None:
            out.append(up)
            up = self.parent[up]
        return out[::-1]


@dataclass(slots=True)
class Import:
    module: str
    args: dict[str, str]
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class Turn:
    """A prompt's own chat message (``<user>...</user>``): its text is the prompt's, not cached."""

    role: str
    text: str
    line: int = 0
    column: int = 0


@dataclass(slots=True)
class Prompt:
    schema: str
    items: list[Import | Text | Turn]  # in document order; free text and turns may come between imports

    @property
    def imports(self) -> list[Import]:
        return [i for i in self.items if isinstance(i, Import)]

    @property
    def has_turns(self) -> bool:
        return any(isinstance(i, Turn) for i in self.items)


# ---- parsing --------------------------------------------------------------------------------
class _Located(TreeBuilder):
    """A tree builder that stamps each element with the line and column where its tag starts."""

    def __init__(self) -> None:
        super().__init__()
        self.parser: Any = None
        self.depth = 0

    def start(self, tag: str, attrs: dict[str, str]) -> Element:  # type: ignore[override]
        line, column = self.parser.CurrentLineNumber, self.parser.CurrentColumnNumber + 1
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise PMLError(f"elements nest deeper than {MAX_DEPTH} levels", line, column)
        for key, value in attrs.items():
            if len(value) > MAX_ATTRIBUTE_CHARS:
                raise PMLError(f"attribute {key!r} is over {MAX_ATTRIBUTE_CHARS} characters", line, column)
        elem = super().start(tag, attrs)
        elem.set("__line", str(line))
        elem.set("__column", str(column))
        return elem

    def end(self, tag: str) -> Element:  # type: ignore[override]
        self.depth -= 1
        return super().end(tag)


def _parse_xml(text: str) -> Element:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_DOCUMENT_BYTES:
        raise PMLError(f"the document is over {MAX_DOCUMENT_BYTES} bytes")
    # defusedxml is imported here, at the first PML document: the engine core imports without it
    import defusedxml.ElementTree as safe_xml
    from defusedxml import DefusedXmlException

    builder = _Located()
    parser = safe_xml.DefusedXMLParser(target=builder, forbid_dtd=True)
    builder.parser = parser.parser
    try:
        parser.feed(text)
        return parser.close()
    except PMLError:
        raise
    except DefusedXmlException as exc:
        raise PMLError(f"refused: {type(exc).__name__} (DTDs and entities are not allowed)") from None
    except safe_xml.ParseError as exc:
        line, column = exc.position
        raise PMLError(f"malformed XML: {_expat_message(exc)}", line, column + 1) from None


def _expat_message(exc: Exception) -> str:
    return str(exc).split(":")[0]


def _at(elem: Element) -> tuple[int, int]:
    return int(elem.get("__line", "0")), int(elem.get("__column", "0"))


def _attrs(elem: Element) -> dict[str, str]:
    return {k: v for k, v in elem.attrib.items() if not k.startswith("__")}


def _name_of(elem: Element, what: str) -> str:
    name = elem.get("name")
    if not name:
        raise PMLError(f"<{elem.tag}> needs a name attribute", *_at(elem))
    if not _NAME.match(name):
        raise PMLError(f"{what} name {name!r} is not a valid name", *_at(elem))
    return name


def _text(s: str | None) -> list[Node]:
    return [Text(s)] if s else []


def _param(elem: Element) -> Param:
    attrs = _attrs(elem)
    name = _name_of(elem, "parameter")
    raw = attrs.get("len", attrs.get("length"))
    if raw is None or not raw.isdigit() or int(raw) < 1:
        raise PMLError(f"parameter {name!r} needs len (or length) = a positive number of tokens", *_at(elem))
    if len(elem) or (elem.text or "").strip():
        raise PMLError(f"parameter {name!r} must be empty", *_at(elem))
    return Param(name, int(raw), *_at(elem))


def _children(elem: Element, schema: _SchemaBuild, parent: str | None, in_role: bool) -> list[Node]:
    nodes: list[Node] = _text(elem.text)
    for child in elem:
        nodes.append(_node(child, schema, parent, in_role))
        nodes += _text(child.tail)
    return nodes


@dataclass(slots=True)
class _SchemaBuild:
    modules: dict[str, Module] = field(default_factory=dict)
    parent: dict[str, str | None] = field(default_factory=dict)
    union_of: dict[str, int] = field(default_factory=dict)
    unions: int = 0


def _node(elem: Element, schema: _SchemaBuild, parent: str | None, in_role: bool) -> Node:
    tag = elem.tag
    if tag == "module":
        name = _name_of(elem, "module")
        if name in ROLES:
            raise PMLError(f"module name {name!r} is a role tag's name; rename the module", *_at(elem))
        if name in schema.modules:
            raise PMLError(f"module {name!r} is defined twice", *_at(elem))
        module = Module(name, [], *_at(elem))
        schema.modules[name] = module
        schema.parent[name] = parent
        module.children = _children(elem, schema, name, in_role)
        return module
    if tag == "union":
        union = Union([], *_at(elem))
        schema.unions += 1
        uid = schema.unions  # nested unions count on; this union keeps its own id
        if (elem.text or "").strip():
            raise PMLError("a <union> holds only <module> elements, not text", *_at(elem))
        for child in elem:
            if child.tag != "module":
                raise PMLError(f"a <union> holds only <module> elements, not <{child.tag}>", *_at(child))
            if (child.tail or "").strip():
                raise PMLError("a <union> holds only <module> elements, not text", *_at(child))
            member = _node(child, schema, parent, in_role)
            assert isinstance(member, Module)
            schema.union_of[member.name] = uid
            union.members.append(member)
        if not union.members:
            raise PMLError("an empty <union>", *_at(elem))
        return union
    if tag in ("param", "parameter"):
        if parent is None:
            raise PMLError("a parameter must be inside a <module>", *_at(elem))
        return _param(elem)
    if tag in ROLES:
        if in_role:
            raise PMLError(f"<{tag}> inside another role tag", *_at(elem))
        return Role(tag, _children(elem, schema, parent, True))
    raise PMLError(f"unknown element <{tag}> in a schema", *_at(elem))


def parse_schema(text: str) -> Schema:
    """A ``<schema name="...">`` document -> Schema; raises PMLError naming line, column and problem."""
    root = _parse_xml(text)
    if root.tag != "schema":
        raise PMLError(f"expected a <schema> document, got <{root.tag}>", *_at(root))
    name = _name_of(root, "schema")
    build = _SchemaBuild()
    children = _children(root, build, None, False)
    for module in build.modules.values():
        seen: set[str] = set()
        for p in _params(module):
            if p.name in seen:
                problem = f"module {module.name!r} has two parameters named {p.name!r}"
                raise PMLError(problem, p.line, p.column)
            seen.add(p.name)
    return Schema(name, children, build.modules, build.parent, build.union_of)


def _params(module: Module) -> list[Param]:
    """The module's own parameters (not those of nested modules)."""
    out: list[Param] = []
    stack: list[Node] = list(module.children)
    while stack:
        node = stack.pop()
        if isinstance(node, Param):
            out.append(node)
        elif isinstance(node, Role):
            stack.extend(node.children)
    return out


def parse_prompt(text: str, schemas: dict[str, Schema]) -> Prompt:
    """A ``<prompt schema="...">`` document, checked against its schema."""
    root = _parse_xml(text)
    if root.tag != "prompt":
        raise PMLError(f"expected a <prompt> document, got <{root.tag}>", *_at(root))
    name = root.get("schema")
    if not name:
        raise PMLError("<prompt> needs a schema attribute", *_at(root))
    schema = schemas.get(name)
    if schema is None:
        known = ", ".join(sorted(schemas)) or "none are registered"
        raise PMLError(f"unknown schema {name!r} (known: {known})", *_at(root))
    items: list[Import | Text | Turn] = [Text(root.text)] if root.text else []
    for child in root:
        if child.tag in ROLES:
            items.append(_turn(child))
        else:
            _imports(child, schema, None, items)
        if child.tail:
            items.append(Text(child.tail))
    _check_imports(schema, [i for i in items if isinstance(i, Import)])
    return Prompt(name, items)


def _turn(elem: Element) -> Turn:
    """A role tag at the top of a prompt: one chat message of plain text."""
    line, column = _at(elem)
    if _attrs(elem):
        raise PMLError(f"<{elem.tag}> takes no attributes", line, column)
    if len(elem):
        inner = elem[0]
        problem = (
            f"<{inner.tag}> inside a <{elem.tag}> turn: a turn holds only text "
            "(import modules outside turns; turns do not nest)"
        )
        raise PMLError(problem, *_at(inner))
    return Turn(elem.tag, elem.text or "", line, column)


def _imports(elem: Element, schema: Schema, parent: str | None, out: list[Import | Text | Turn]) -> None:
    line, column = _at(elem)
    if elem.tag in ROLES:
        problem = f"<{elem.tag}> inside the import of <{parent}>: role turns go directly inside <prompt>"
        raise PMLError(problem, line, column)
    module = schema.modules.get(elem.tag)
    if module is None:
        problem = (
            f"unknown module <{elem.tag}> in schema {schema.name!r} "
            f"(nor a role: roles are {', '.join(f'<{r}>' for r in ROLES)})"
        )
        raise PMLError(problem, line, column)
    if parent is not None and schema.parent[elem.tag] != parent:
        raise PMLError(f"<{elem.tag}> is not a module of <{parent}> in schema {schema.name!r}", line, column)
    if (elem.text or "").strip() and not len(elem):
        raise PMLError(f"an import of <{elem.tag}> holds text; put free text outside it", line, column)
    args = _attrs(elem)
    if args:  # an import without arguments (the usual one) needs no walk over the module's nodes
        params = {p.name for p in _params(module)}
        for key in args:
            if key not in params:
                raise PMLError(f"module {elem.tag!r} has no parameter {key!r}", line, column)
    out.append(Import(elem.tag, args, line, column))
    for child in elem:
        _imports(child, schema, elem.tag, out)
        if (child.tail or "").strip():
            raise PMLError(f"text inside the import of <{elem.tag}>; put free text outside it", *_at(child))


def _check_imports(schema: Schema, imports: list[Import]) -> None:
    """No module twice; at most one member of each union, counting the modules an import brings along."""
    names: dict[str, Import] = {}
    for imp in imports:
        if imp.module in names:
            raise PMLError(f"module {imp.module!r} is imported twice", imp.line, imp.column)
        names[imp.module] = imp
    chosen: dict[int, str] = {}
    for imp in imports:
        for name in [*schema.ancestors(imp.module), imp.module]:
            union = schema.union_of.get(name)
            if union is None or chosen.get(union, name) == name:
                if union is not None:
                    chosen[union] = name
                continue
            problem = f"modules {chosen[union]!r} and {name!r} are members of one union"
            raise PMLError(problem, imp.line, imp.column)


def closure(schema: Schema, prompt: Prompt) -> list[str]:
    """The modules a prompt uses: its imports and every module that encloses one."""
    used: set[str] = set()
    for imp in prompt.imports:
        used.add(imp.module)
        used.update(schema.ancestors(imp.module))
    return [name for name in schema.modules if name in used]
