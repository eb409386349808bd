"""Text <-> token ids, the snapshot's chat template (rendered in a bounded sandbox), and streaming
detokenization."""

from __future__ import annotations

import json
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.utils import Namespace
from tokenizers import Tokenizer

from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.files import MAX_SIDE_FILE_BYTES, read_json_file, read_text_file

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # GLM's thinking block (added tokens in GLM-5's vocabulary)
SIDE_FILE_MAX_BYTES = 16 << 20  # a snapshot's JSON side files (tokenizer_config.json, generation_config.json)
TEMPLATE_SOURCE_MAX_CHARS = 1 << 20  # the chat template's own text

# One render of the chat template. The template comes with the snapshot, so it is untrusted code: jinja2's
# sandbox keeps it away from Python's internals but lets it loop and allocate without end.
TEMPLATE_MAX_STEPS = 1_000_000  # loop iterations, calls, filters, operators and literals
TEMPLATE_MAX_SECONDS = 10.0
TEMPLATE_MAX_CHARS = 16 << 20  # the rendered prompt, and the text of any one value the template builds
TEMPLATE_MAX_BUILT = 256 << 20  # everything the template builds, in all [characters; 8 per list or dict item]
TEMPLATE_MAX_INT_BITS = 1 << 16


class ChatTokenizer:
    """The snapshot's `tokenizer.json` plus its jinja2 chat template (from tokenizer_config.json).

    vocab_size: the model's token ids (default: the snapshot's config.json `vocab_size`, where it has one); a
    tokenizer that can give an id past them is refused here, before any text is encoded."""

    def __init__(self, directory: str | Path, vocab_size: int | None = None):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise GlmkitError(f"{path}: tokenizer missing from the snapshot")
        text = read_text_file(path, MAX_SIDE_FILE_BYTES, "a tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise GlmkitError(f"{path}: cannot load tokenizer ({e})") from None
        # padding would add the file's pad_id, truncation cut a prompt short: glmkit encodes whole texts
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        if vocab_size is None and (directory / "config.json").is_file():
            vocab_size = ModelConfig.from_file(directory / "config.json").vocab_size
        if vocab_size is not None:
            _check_token_ids(self.tokenizer, path, vocab_size)
        self.chat_template = _load_chat_template(directory)
        self._compiled: jinja2.Template | str | None = None  # the compiled template, or why it does not compile

    def encode(self, text: str) -> list[int]:
        """Plain text (special-token strings like `<|user|>` become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def render_chat(self, messages: list[dict[str, Any]], /, enable_thinking: bool = True,
                    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> str:
        """`tools` (OpenAI function schemas) and `template_kwargs` are template variables, as in transformers
        (any name, `self` and `messages` included: those two are positional-only here). The render is bounded
        (TEMPLATE_MAX_*): a template that outruns a bound fails with a GlmkitError saying which."""
        variables = {**template_kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "enable_thinking": enable_thinking, "tools": tools}
        return render_bounded(self._template(), variables)

    def encode_chat(self, messages: list[dict[str, Any]], /, enable_thinking: bool = True, **kwargs: Any
                    ) -> list[int]:
        return self.encode(self.render_chat(messages, enable_thinking, **kwargs))

    def _template(self) -> jinja2.Template:
        """The chat template, compiled once in a bounded sandbox."""
        if self.chat_template is None:
            raise GlmkitError("this snapshot has no chat template (tokenizer_config.json 'chat_template' or "
                              "chat_template.jinja, missing or empty)")
        if self._compiled is None:
            try:
                self._compiled = BoundedSandbox().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                self._compiled = f"chat template failed: {e}"
            except (RecursionError, MemoryError) as e:  # a template nested past what the compiler can take
                self._compiled = f"chat template failed to compile: {type(e).__name__}"
        if isinstance(self._compiled, str):
            raise GlmkitError(self._compiled)
        return self._compiled


def _check_token_ids(tokenizer: Tokenizer, path: Path, vocab_size: int) -> None:
    """Refuse a tokenizer any of whose ids (its model's vocabulary and its added tokens: all that encoding without
    special-token templates or padding gives) is past the model's `vocab_size` ids (the embedding has no row for
    it)."""
    top = max([*tokenizer.get_vocab(with_added_tokens=False).values(), *tokenizer.get_added_tokens_decoder()],
              default=-1)
    if top >= vocab_size:
        raise GlmkitError(f"{path}: token id {top} ({str(tokenizer.id_to_token(top))[:40]!r}) is outside the "
                          f"model's vocabulary (vocab_size {vocab_size} in config.json)")


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# ---- snapshot side files ---------------------------------------------------------------------------

def read_side_json(path: Path) -> dict[str, Any]:
    """A snapshot's JSON side file (tokenizer_config.json, generation_config.json): a regular file of at most
    SIDE_FILE_MAX_BYTES, UTF-8 JSON holding an object. Raises GlmkitError naming it."""
    data = read_json_file(path, SIDE_FILE_MAX_BYTES)
    if not isinstance(data, dict):
        raise GlmkitError(f"{path}: not a valid JSON object")
    return data


def _read_template_file(path: Path) -> str:
    """chat_template.jinja: a regular file of at most 4 bytes a template character, UTF-8."""
    return read_text_file(path, 4 * TEMPLATE_SOURCE_MAX_CHARS, "a chat template")


def _load_chat_template(directory: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's `chat_template` (a named list's "default"); an empty or
    all-whitespace template counts as none."""
    jinja_file = directory / "chat_template.jinja"
    template = _read_template_file(jinja_file) if jinja_file.is_file() else None
    source = jinja_file
    if not (template or "").strip():
        config = directory / "tokenizer_config.json"
        if not config.is_file():
            return None
        template, source = read_side_json(config).get("chat_template"), config
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
    if not isinstance(template, str) or not template.strip():
        return None
    if len(template) > TEMPLATE_SOURCE_MAX_CHARS:
        raise GlmkitError(f"{source}: the chat template is {len(template):,} characters, more than "
                          f"{TEMPLATE_SOURCE_MAX_CHARS:,}")
    return template


# ---- the bounded template sandbox ---------------------------------------------------------------------

class _TemplateOverrun(BaseException):
    """A render went past a TEMPLATE_MAX_* bound. A BaseException: code that the template reaches (jinja's own
    and its filters) catches Exception here and there, and must not swallow this."""


class _Budget:
    """What one render has used so far, and the text sizes of the containers it has measured."""

    def __init__(self) -> None:
        self.steps = 0
        self.built = 0
        self.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
        # id -> (container, text size, nesting depth): templates cannot change a list or dict (the immutable
        # sandbox), so a measure holds for the whole render; the container is kept so that its id is not reused
        self.measured: dict[int, tuple[Any, int, int]] = {}

    def step(self) -> None:
        self.steps += 1
        if self.steps > TEMPLATE_MAX_STEPS:
            raise _TemplateOverrun(f"more than {TEMPLATE_MAX_STEPS:,} steps (loop iterations, calls, operators)")
        if time.monotonic() > self.deadline:
            raise _TemplateOverrun(f"more than {TEMPLATE_MAX_SECONDS:g} s")

    def check(self, size: int, what: str) -> None:
        """Refuse to build `what`, of about `size` characters, when that is past TEMPLATE_MAX_CHARS."""
        if size > TEMPLATE_MAX_CHARS:
            raise _TemplateOverrun(f"{what} would make a value of {size:,} characters (at most "
                                   f"{TEMPLATE_MAX_CHARS:,})")

    def took(self, value: Any, what: str) -> Any:
        """`value` was just built by `what`: check its text size and count it against TEMPLATE_MAX_BUILT."""
        if isinstance(value, str):
            self._count(len(value))
            self.check(len(value), what)
        elif (children := _children(value)) is not None:
            self._count(8 * len(children))
            self.check(self.text_size(value), what)
        return value

    def _count(self, size: int) -> None:
        self.built += size
        if self.built > TEMPLATE_MAX_BUILT:
            raise _TemplateOverrun(f"builds more than {TEMPLATE_MAX_BUILT:,} characters in all")

    def remember(self, container: Any, size: int, depth: int) -> None:
        """Record a new list's or tuple's measure, worked out from its operands' (so it is not walked)."""
        self.measured[id(container)] = (container, size, depth)

    def text_size(self, value: Any) -> int:
        """An upper bound on the length of str(value) [characters] (exact for a string), and on its JSON."""
        return len(value) if isinstance(value, str) else self.measure(value)[0]

    def measure(self, root: Any) -> tuple[int, int]:
        """(an upper bound on the length of str(root) or of its JSON [characters], its nesting depth). A part
        held several times counts each time, as it prints: a few levels of lists that each hold the one below
        many times make a size that grows as a power, measured in time linear in the distinct parts."""
        changing: dict[int, tuple[int, int]] = {}  # namespaces: `set ns.x = ...` changes them between measures
        on_path: set[int] = set()

        def known(node: Any) -> bool:
            return id(node) in self.measured or id(node) in changing

        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            children = _children(node)
            if children is None or known(node):
                continue
            if not expanded:
                on_path.add(id(node))
                stack.append((node, True))
                stack.extend((c, False) for c in children
                             if _children(c) is not None and not known(c) and id(c) not in on_path)
                continue
            on_path.discard(id(node))
            parts = [self._part(c, changing) for c in children]
            size, depth = 2 + sum(n + 2 for n, _ in parts), 1 + max((d for _, d in parts), default=0)
            if isinstance(node, Namespace):
                changing[id(node)] = (size, depth)
            else:
                self.measured[id(node)] = (node, size, depth)
        return self._part(root, changing)

    def _part(self, value: Any, changing: dict[int, tuple[int, int]]) -> tuple[int, int]:
        if id(value) in self.measured:
            return self.measured[id(value)][1:]
        if isinstance(value, str):
            size = _quoted_size(value)
            if len(value) >= 256:  # a long string is scanned once
                self.measured[id(value)] = (value, size, 0)
            return size, 0
        if id(value) in changing:
            return changing[id(value)]
        if _children(value) is not None:  # a container that holds itself: printed as '[...]'
            return 5, 1
        return _leaf_size(value), 0


def _quoted_size(text: str) -> int:
    """An upper bound on len(repr(text)) and len(json.dumps(text, ensure_ascii=False)) [characters]."""
    size = len(text) + 2 + text.count('"') + text.count("'") + text.count("\\")
    if text.isprintable():
        return size
    common = text.count("\n") + text.count("\t") + text.count("\r")  # each escaped as two characters
    rest = text.replace("\n", "").replace("\t", "").replace("\r", "") if common else text
    if rest.isprintable():
        return size + common
    return size + common + 9 * sum(not c.isprintable() for c in rest)  # up to '\U000e0001' each


def _escaped_size(text: str) -> int:
    """len(markupsafe.escape(text)): & < > " ' become &amp; &lt; &gt; &#34; &#39;."""
    return (len(text) + 4 * text.count("&") + 3 * (text.count("<") + text.count(">"))
            + 4 * (text.count('"') + text.count("'")))


def _children(value: Any) -> list[Any] | None:
    """The parts a container prints (None for anything else)."""
    if isinstance(value, list | tuple | set | frozenset):
        return list(value)
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, Namespace):
        return list(value._Namespace__attrs.values())  # what its repr prints
    return None


def _leaf_size(value: Any) -> int:
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    return 32  # a float, None, or one of jinja's small objects (Undefined, a macro, a loop)


def _width(value: Any) -> int:
    return value if isinstance(value, int) else len(value) if isinstance(value, str) else 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    """A filter's or method's argument, given by position or by name."""
    return args[index] if len(args) > index else kwargs.get(name, default)


_PRINTF_FIELD = re.compile(r"%(\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)")


def _printf_size(budget: _Budget, fmt: str, args: Any) -> int:
    """An upper bound on len(fmt % args) [characters]."""
    fields = [m for m in _PRINTF_FIELD.finditer(fmt) if m.group(4) != "%"]
    if any(m.group(2) == "*" or m.group(3) == "*" for m in fields):
        raise _TemplateOverrun("'%' formatting with '*' widths is not allowed in a chat template")
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    return len(fmt) + sum(int(m.group(2) or 0) + int(m.group(3) or 0) + _widest(budget, values, m.group(4) in "ra")
                          for m in fields)


def _format_size(budget: _Budget, fmt: str, values: list[Any]) -> int:
    """An upper bound on len(fmt.format(...)) of `values` [characters]."""
    fields = [(spec or "", conversion) for _, name, spec, conversion in string.Formatter().parse(fmt)
              if name is not None]
    if any("{" in spec for spec, _ in fields):
        raise _TemplateOverrun("nested format specs are not allowed in a chat template")
    return len(fmt) + sum(sum(map(int, re.findall(r"\d+", spec))) + _widest(budget, values, conversion in ("r", "a"))
                          for spec, conversion in fields)


def _widest(budget: _Budget, values: list[Any], as_repr: bool) -> int:
    """The longest any of `values` prints, with str() or (as_repr) repr()."""
    return max((_quoted_size(v) if as_repr and isinstance(v, str) else budget.text_size(v) for v in values),
               default=0)


def _replace_size(text: str, old: str, new: str, count: Any = None) -> int:
    n = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(text) + n * max(len(new) - len(old), 0)


def _join_size(budget: _Budget, separator: str, items: list[Any]) -> int:
    return sum(budget.text_size(item) for item in items) + len(separator) * max(len(items) - 1, 0)


def _str_method_size(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """An upper bound on len(text.<name>(*args, **kwargs)) for the methods that can make a string much longer
    than their inputs (str.join and str.format are measured elsewhere); None for the others."""
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(text), _width(_arg(args, kwargs, 0, "width")))
    if name == "expandtabs":
        return len(text) * max(_width(_arg(args, kwargs, 0, "tabsize", 8)), 1)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replace_size(text, args[0], args[1], _arg(args, kwargs, 2, "count"))
    if name == "translate" and args and isinstance(args[0], dict):
        return len(text) * max(max((len(v) for v in args[0].values() if isinstance(v, str)), default=1), 1)
    return None


def _filter_size(budget: _Budget, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """An upper bound on the size of what the filter `name` returns [characters], for the filters that can make
    a value much longer than their inputs; None for the others (they are checked on what they return)."""
    value = args[0] if args else None
    if name == "center":
        return max(budget.text_size(value), _width(_arg(args, kwargs, 1, "width", 80)))
    if name == "indent":
        lines = value.count("\n") + 1 if isinstance(value, str) else budget.text_size(value)
        return budget.text_size(value) + lines * _width(_arg(args, kwargs, 1, "width", 4))
    if name == "replace" and isinstance(value, str) and len(args) >= 3:
        return _replace_size(value, str(args[1]), str(args[2]), _arg(args, kwargs, 3, "count"))
    if name == "format" and isinstance(value, str):
        return _printf_size(budget, value, kwargs or tuple(args[1:]))
    if name in ("escape", "e", "forceescape"):
        return _escaped_size(value) if isinstance(value, str) else 6 * budget.text_size(value)
    if name == "urlencode":
        return 12 * budget.text_size(value)  # %XX for each of a character's (up to four) UTF-8 bytes
    if name == "tojson":
        size, depth = (_quoted_size(value), 0) if isinstance(value, str) else budget.measure(value)
        if _arg(args, kwargs, 1, "ensure_ascii", False):
            size *= 6  # \uXXXX for each character
        separators = _arg(args, kwargs, 3, "separators") or ()
        per_item = _width(_arg(args, kwargs, 2, "indent")) * depth + 1 + sum(map(_width, separators))
        return size + (size // 2 + 1) * per_item  # every item printed takes at least two characters
    if name == "join" and isinstance(value, list):
        separator = _arg(args, kwargs, 1, "d", "")
        return _join_size(budget, separator if isinstance(separator, str) else "", value)
    if name in ("batch", "slice"):
        return 2 * _width(args[1] if len(args) > 1 else 0)  # lists of that many items, `fill_with` included
    if name == "sum" and not isinstance(_arg(args, kwargs, 2, "start", 0), int | float):
        raise _TemplateOverrun("the 'sum' filter adds numbers only in a chat template")  # lists: quadratic
    return None


# filters with no business in a chat prompt whose output sizes are hard to bound (each multiplies its input)
_DROPPED_FILTERS = ("urlize", "wordwrap", "pprint", "xmlattr")


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles a template so that its loops, `~` joins and list / dict / tuple literals go through the
    environment's counters (BoundedSandbox.counted, join_parts, literal)."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        node.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None,
                               lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.join_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _literal(self, visit: Callable[[Any, Frame], None], node: nodes.Expr, frame: Frame) -> None:
        self.write("environment.literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "store":  # an assignment target, not a value
            super().visit_Tuple(node, frame)
        else:
            self._literal(super().visit_Tuple, node, frame)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, bounded (TEMPLATE_MAX_*): every loop iteration, call, filter, operator and
    literal is a step; what they build is measured before (where it can outgrow its inputs) or after.
    render_bounded() renders with a fresh budget; one environment serves any number of threads."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         finalize=self._finalize)
        self._local = threading.local()
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs
        self.globals["raise_exception"] = _raise_template_error
        self.filters["tojson"] = _tojson  # transformers' version: GLM templates call tojson(ensure_ascii=False)
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()
                        if name not in _DROPPED_FILTERS}

    @property
    def budget(self) -> _Budget | None:
        """The current render's budget (None while compiling, when jinja folds constants)."""
        return getattr(self._local, "budget", None)

    def render_template(self, template: jinja2.Template, variables: dict[str, Any]) -> str:
        """`template` (compiled here) rendered with `variables`, under a fresh budget."""
        self._local.budget = budget = _Budget()
        try:
            parts: list[str] = []
            size = 0
            for part in template.generate(variables):  # a dict, not keywords: a variable may be named `self`
                size += len(part)
                budget.check(size, "the rendered prompt")
                parts.append(part)
            return "".join(parts)
        finally:
            self._local.budget = None

    # ---- what the compiled template calls ----

    def counted(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """A `for` loop's items, one step each."""
        budget = self.budget
        for item in iterable:
            if budget is not None:
                budget.step()
            yield item

    def join_parts(self, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`"""
        budget = self.budget
        if budget is None:
            return "".join(map(str, parts))
        budget.step()
        budget.check(sum(budget.text_size(p) for p in parts), "'~'")
        return budget.took("".join(map(str, parts)), "'~'")

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]  # jinja's "".join, for block bodies
        budget = self.budget
        if budget is None:
            return "".join(parts)
        parts = list(parts)
        budget.check(sum(len(p) for p in parts), "a block")
        return budget.took("".join(parts), "a block")

    def literal(self, value: Any) -> Any:
        budget = self.budget
        if budget is not None:
            budget.step()
            budget.took(value, "a literal")
        return value

    def _finalize(self, value: Any) -> Any:
        """Each `{{ ... }}`'s value, before it becomes text."""
        budget = self.budget
        if budget is not None and not isinstance(value, str):
            budget.check(budget.text_size(value), "'{{ }}'")
        return value

    # ---- jinja2's sandbox hooks ----

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget
        if budget is not None:
            budget.step()
            _check_binop(budget, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if budget is None:
            return result
        if isinstance(result, list | tuple) and operator in ("+", "*"):
            sequences = [x for x in (left, right) if isinstance(x, list | tuple)]
            parts = [budget.measure(x) for x in sequences]
            if operator == "+":
                size = sum(n - 2 for n, _ in parts) + 2
            else:  # n copies of the one sequence's items
                size = (parts[0][0] - 2) * (len(result) // len(sequences[0]) if sequences[0] else 0) + 2
            budget.remember(result, size, max(d for _, d in parts))
        return budget.took(result, f"'{operator}'")

    def getitem(self, obj: Any, argument: Any) -> Any:
        result = super().getitem(obj, argument)
        budget = self.budget
        if budget is not None and isinstance(argument, slice):
            budget.step()
            budget.took(result, "a slice")
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.step()
        what = f"'{getattr(__obj, '__name__', 'a call')}'"
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") == "join" and args:
            args = (list(args[0]), *args[1:])  # measured below, then joined
            budget.check(_join_size(budget, owner, args[0]), what)
        elif isinstance(owner, str):
            size = _str_method_size(owner, __obj.__name__, args, kwargs)
            if size is not None:
                budget.check(size, what)
        return budget.took(super().call(__context, __obj, *args, **kwargs), what)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        text = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = self.budget
            if budget is None:
                return formatter(*args, **kwargs)
            budget.step()
            mapping = args[0] if value.__name__ == "format_map" and args and isinstance(args[0], dict) else kwargs
            values = [*mapping.values()] if mapping is not kwargs else [*args, *kwargs.values()]
            budget.check(_format_size(budget, text, values), "'format'")
            return budget.took(formatter(*args, **kwargs), "'format'")

        return bounded

    def _bounded_filter(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` measured (see _filter_size). Marked pass_context so that jinja never runs it while
        compiling (constant folding happens outside any budget)."""
        takes = getattr(getattr(function, "jinja_pass_arg", None), "name", None)  # jinja's pass_context & co.
        what = f"the '{name}' filter"

        @jinja2.pass_context
        def bounded(context: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> Any:
            budget = self.budget
            if budget is not None:
                budget.step()
                if name == "join" and args:
                    args = (list(args[0]), *args[1:])  # measured below, then joined
                size = _filter_size(budget, name, args, kwargs)
                if size is not None:
                    budget.check(size, what)
            first = {"context": (context,), "eval_context": (context.eval_ctx,),
                     "environment": (context.environment,)}.get(takes or "", ())
            result = function(*first, *args, **kwargs)
            return result if budget is None else budget.took(result, what)

        return bounded


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse `left <operator> right` when its result would be past the bounds (checked before it is built)."""
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "*":
        if ints and left.bit_length() + right.bit_length() > TEMPLATE_MAX_INT_BITS:
            raise _TemplateOverrun(f"'*' would make an integer of more than {TEMPLATE_MAX_INT_BITS:,} bits")
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sequence, str | list | tuple) and isinstance(times, int):
            budget.check(budget.text_size(sequence) * max(times, 0), "'*'")
    elif operator == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > TEMPLATE_MAX_INT_BITS:
            raise _TemplateOverrun(f"'**' would make an integer of more than {TEMPLATE_MAX_INT_BITS:,} bits")
    elif operator == "%" and isinstance(left, str):
        budget.check(_printf_size(budget, left, right), "'%'")


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render a template compiled by a BoundedSandbox. Whatever goes wrong in it (an overrun, a filter given the
    wrong type, raise_exception(), a recursion too deep) is a one-line GlmkitError."""
    environment = template.environment
    assert isinstance(environment, BoundedSandbox)
    try:
        return environment.render_template(template, variables)
    except _TemplateOverrun as e:
        raise GlmkitError(f"chat template stopped: {e}") from None
    except jinja2.TemplateError as e:
        raise GlmkitError(f"chat template failed: {e}") from None
    except Exception as e:  # the template is code: whatever it raises (RecursionError, MemoryError...) is its failure
        raise GlmkitError(f"chat template failed: {type(e).__name__}: {e}") from None


class StreamDecoder:
    """Turns a growing list of token ids into text pieces without ever emitting broken UTF-8.

    Decodes a short window of recent tokens and emits only the new suffix once it no longer ends in
    a replacement character (an incomplete multi-byte sequence split across tokens).
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_start = 0  # window start: decoding from here gives stable text
        self.emitted_upto = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.emitted_upto])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_start = self.emitted_upto
        self.emitted_upto = len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is left at the end of generation (may contain a replacement character)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.emitted_upto])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        self.prefix_start = self.emitted_upto = len(self.ids)
        return text[len(prefix):]


def replies_in_thinking(prompt_text: str) -> bool:
    """Whether the reply starts inside the thinking block: the rendered prompt ends with `<think>` (thinking on)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)
