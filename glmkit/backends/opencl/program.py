"""The OpenCL program (glmkit/backends/opencl/kernels/*.cl) built for one context, and its kernels launched with
their arguments by name.

Each kernel's parameter list is read once from the program text (`kernel_signatures`): its names, and the NumPy
type of each scalar. Kernels stamped out by macros (`QUANT_KERNELS(q4, 4)` -> mv_q4, mvt_q4, ...) are expanded
first, and so are the parameter blocks they share (`WARGS`), so every built kernel has its signature.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from glmkit.backends.opencl.device import cl
from glmkit.backends.opencl.kernels import source

SCALAR_TYPES = {"uint": np.uint32, "ulong": np.uint64, "int": np.int32, "float": np.float32,
                "double": np.float64}  # OpenCL C -> NumPy


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters in order: their names, and the NumPy type of each scalar (None for a buffer)."""

    names: tuple[str, ...]
    scalars: tuple[type | None, ...]
    index: dict[str, int] = field(init=False, compare=False, repr=False)  # name -> position

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {name: i for i, name in enumerate(self.names)})

    def ordered(self, kernel: str, args: dict[str, Any]) -> list[Any]:
        """The values of `args` (every parameter named once) in parameter order."""
        if args.keys() != self.index.keys():
            missing = [n for n in self.names if n not in args]
            unknown = sorted(set(args) - set(self.names))
            raise TypeError(f"kernel {kernel}: missing arguments {missing}, unknown arguments {unknown}")
        return [args[name] for name in self.names]


_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_DEFINE = re.compile(r"#\s*define\s+(\w+)(?:\(([^)]*)\))?(.*)", re.S)  # a parameter list only right after the name
_KERNEL_NAME = re.compile(r"\bvoid\s+(\w+)\s*\(")


def _balanced(text: str, open_at: int) -> int:
    """The index just past the parenthesis that closes the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unbalanced parentheses in the kernel source")


def _split_args(text: str) -> list[str]:
    """A macro call's or parameter list's items: `text` split at its top-level commas."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def _substitute(body: str, names: dict[str, str]) -> str:
    """`body` with every identifier in `names` replaced, then `##` pastes joined."""
    out = re.sub(r"\b\w+\b", lambda m: names.get(m.group(0), m.group(0)), body)
    return re.sub(r"\s*##\s*", "", out)


def _macros(text: str) -> tuple[str, dict[str, tuple[list[str], str]], dict[str, str]]:
    """OpenCL C `text` without comments and preprocessor lines, its function-like macros (name -> (parameters,
    body)) and its object-like ones (name -> body)."""
    text = _COMMENT.sub(" ", text).replace("\\\n", " ")
    functions: dict[str, tuple[list[str], str]] = {}
    objects: dict[str, str] = {}
    code = []
    for line in text.split("\n"):
        if not line.lstrip().startswith("#"):
            code.append(line)
        elif define := _DEFINE.fullmatch(line.strip()):
            name, params, body = define.groups()
            if params is None:
                objects[name] = body.strip()
            else:
                functions[name] = ([p.strip() for p in params.split(",") if p.strip()], body.strip())
    return "\n".join(code), functions, objects


def _expand_stamps(code: str, functions: dict[str, tuple[list[str], str]]) -> str:
    """`code` with every call of a macro that stamps out kernels (its body holds __kernel, or calls another such
    macro) replaced by its body."""
    stamps = {name for name, (_, body) in functions.items() if "__kernel" in body}
    while grown := {name for name, (_, body) in functions.items()
                    if name not in stamps and any(re.search(rf"\b{s}\s*\(", body) for s in stamps)}:
        stamps |= grown
    if not stamps:
        return code
    call = re.compile(r"\b(" + "|".join(sorted(stamps)) + r")\s*\(")
    while m := call.search(code):
        end = _balanced(code, m.end() - 1)
        params, body = functions[m.group(1)]
        values = _split_args(code[m.end():end - 1])
        if len(values) != len(params):
            raise ValueError(f"{m.group(1)} called with {len(values)} arguments, defined with {len(params)}")
        code = code[:m.start()] + " " + _substitute(body, dict(zip(params, values, strict=True))) + " " + code[end:]
    return code


def _signature(kernel: str, params: str, objects: dict[str, str]) -> Signature:
    """The signature of parameter list `params`, after the object-like macros in it (WARGS) are expanded."""
    shared = re.compile(r"\b(" + "|".join(objects) + r")\b") if objects else None
    while shared is not None and shared.search(params):
        params = shared.sub(lambda m: objects[m.group(1)], params)
    names, scalars = [], []
    for param in _split_args(params):
        words = re.findall(r"\w+", param)
        names.append(words[-1])
        if "*" in param:
            scalars.append(None)
        elif words[-2] in SCALAR_TYPES:
            scalars.append(SCALAR_TYPES[words[-2]])
        else:
            raise ValueError(f"kernel {kernel}: parameter '{param}' of a type with no NumPy scalar")
    return Signature(tuple(names), tuple(scalars))


def parse_signatures(text: str) -> dict[str, Signature]:
    """The signature of every kernel in OpenCL C `text`, by kernel name."""
    code, functions, objects = _macros(text)
    code = _expand_stamps(code, functions)
    signatures = {}
    for m in re.finditer(r"\b__kernel\b", code):
        found = _KERNEL_NAME.search(code, m.end())
        if found is None:
            raise ValueError("a __kernel without a name in the kernel source")
        params = code[found.end():_balanced(code, found.end() - 1) - 1]
        signatures[found.group(1)] = _signature(found.group(1), params, objects)
    return signatures


@cache
def kernel_signatures() -> dict[str, Signature]:
    """Every kernel of the program text (`kernels.source()`) by name."""
    return parse_signatures(source())


class Program:
    """The kernels built for context `ctx` with compile `options` (-D knobs), each launched with its arguments by
    name: `run` for one launch, `Launch` for a launch bound once and enqueued many times."""

    def __init__(self, ctx: Any, options: list[str]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # clang's notes about float16 ABI on AVX2 are not actionable
            self.built = cl.Program(ctx, source()).build(options=options)
        self.signatures = kernel_signatures()
        self._shared: dict[str, Any] = {}  # kernel objects of `run` (their arguments are set on every call)

    def new_kernel(self, name: str) -> Any:
        """A kernel object of its own (its arguments stay as set), with its scalar argument types."""
        kernel = cl.Kernel(self.built, name)
        kernel.set_scalar_arg_dtypes(list(self.signatures[name].scalars))
        return kernel

    def run(self, queue: Any, name: str, size: tuple[int, ...], local: tuple[int, ...] | None, **args: Any) -> Any:
        """Enqueue kernel `name` once with every argument named; returns its event."""
        kernel = self._shared.get(name)
        if kernel is None:
            kernel = self._shared[name] = self.new_kernel(name)
        return kernel(queue, size, local, *self.signatures[name].ordered(name, args))


class Launch:
    """A kernel with its arguments bound by name, on its own kernel object: enqueue it as often as needed, changing
    single arguments in between (`set`: the device decode step's per-token positions and cache buffers)."""

    def __init__(self, program: Program, queue: Any, name: str, size: tuple[int, ...], local: tuple[int, ...] | None,
                 args: dict[str, Any]) -> None:
        self.queue = queue
        self.program, self.name = program, name
        self.kernel = program.new_kernel(name)
        signature = program.signatures[name]
        self.args = signature.ordered(name, args)  # an OpenCL kernel does not keep its buffers alive: this does
        self.kernel.set_args(*self.args)
        self._index, self._types = signature.index, signature.scalars
        self.size, self.local = size, local
        self.offset: tuple[int, ...] | None = None  # the global work offset (`at_row`)

    def at_row(self, dim: int, row: int) -> Launch:
        """This launch for token row `row` alone: the same kernel and arguments on a kernel object of its own, global
        size 1 in dimension `dim` offset to `row` (its get_global_id(dim) is `row`: the kernel reads and writes that
        row of its per-row buffers). A kernel whose row index is its global id in `dim` only."""
        copy = Launch(self.program, self.queue, self.name, self.size, self.local,
                      {name: self.args[i] for name, i in self._index.items()})
        copy.size = tuple(1 if d == dim else n for d, n in enumerate(self.size))
        copy.offset = tuple(row if d == dim else 0 for d in range(len(self.size)))
        return copy

    def set(self, **named: Any) -> None:
        """Set the arguments given by name (unchanged ones cost nothing)."""
        for name, value in named.items():
            try:
                index = self._index[name]
            except KeyError:
                raise TypeError(f"kernel {self.kernel.function_name} has no parameter {name}") from None
            kind = self._types[index]
            if self.args[index] is value or (kind is not None and self.args[index] == value):
                continue  # unchanged (most arguments stay put from token to token)
            if kind is None:
                self.kernel.set_arg(index, value)
            else:  # as pyopencl's own invokers set scalars (set_arg's type dispatch is far slower)
                self.kernel._set_arg_buf(index, kind(value))
            self.args[index] = value

    def enqueue(self, wait_for: list | None = None) -> Any:
        """Queue it (after the events `wait_for` too, e.g. a user event the host sets); its event."""
        return cl.enqueue_nd_range_kernel(self.queue, self.kernel, self.size, self.local, self.offset,
                                          wait_for=wait_for)
