#!/usr/bin/env python3
"""Checks llama-cpp-python's ctypes declarations against the llama.cpp headers it is built with.

The binding declares every C function (argument and return types) and struct (fields in order) by
hand, for the llama.cpp release it vendors. Built on another release, a changed signature or struct
would not fail anywhere: ctypes would pass the wrong bytes and the engine would crash or compute
garbage. So before building, this reads the binding's declarations from the source tree (without
loading any library) and has the C++ compiler check each one against `include/llama.h`: per function
the parameter count and each parameter's class and size (integer, float, pointer, struct by value),
per struct its size and every field's offset, per enum constant its value.

    python installer/llama_abi.py SOURCE_TREE    # a llama-cpp-python source tree (vendor/llama.cpp inside)

A mismatch in what the appliance's code calls (`L.name` in engines/ and appliance/, and the structs
those functions take) fails: exit 1, one line per mismatch. Any other mismatch is a warning (the
binding's own bugs in corners we never call: llama-cpp-python 0.3.36 declares llama_opt_params with
fields its own vendored llama.cpp does not have). Exit 2 on a usage or tool error.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Function:
    name: str
    ret: tuple[str, int]
    args: tuple[tuple[str, int], ...]
    structs: tuple[str, ...] = ()  # the structs it takes or gives, by value or by pointer


@dataclass(frozen=True)
class Struct:
    name: str
    size: int
    # (field, offset, members): `members` are a nested struct's or union's own (field, offset),
    # what C names when it declares that struct or union anonymous
    fields: tuple[tuple[str, int, tuple[tuple[str, int], ...]], ...]


@dataclass(frozen=True)
class Declarations:
    functions: tuple[Function, ...]
    structs: tuple[Struct, ...]
    constants: tuple[tuple[str, int], ...]


class _Recorded:
    """What `getattr(library, name)` gives while the binding is read: takes argtypes and restype."""

    def __init__(self, name: str) -> None:
        self.c_name = name
        self.argtypes: list = []
        self.restype = None

    def __call__(self, *_args: object) -> int:
        return 1  # a call the binding makes at import (llama_max_devices)


class _Library:
    def __init__(self) -> None:
        self.seen: dict[str, _Recorded] = {}

    def __getattr__(self, name: str) -> _Recorded:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.seen.setdefault(name, _Recorded(name))


def abi_class(t: object) -> tuple[str, int]:
    """A ctypes type as the C ABI passes it: (class, size); class is v(oid), p(ointer), f(loat),
    s(truct by value) or i(nteger, bool and enum included)."""
    if t is None:
        return ("v", 0)
    assert isinstance(t, type)
    pointer = ctypes.sizeof(ctypes.c_void_p)
    if issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)) or t in (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p):  # type: ignore[attr-defined]
        return ("p", pointer)
    if issubclass(t, (ctypes.Structure, ctypes.Union)):
        return ("s", ctypes.sizeof(t))
    if t in (ctypes.c_float, ctypes.c_double, ctypes.c_longdouble):
        return ("f", ctypes.sizeof(t))
    return ("i", ctypes.sizeof(t))


def _struct_names(types_: list) -> tuple[str, ...]:
    out = []
    for t in types_:
        while isinstance(t, type) and issubclass(t, ctypes._Pointer):  # type: ignore[attr-defined]
            t = t._type_
        if isinstance(t, type) and issubclass(t, ctypes.Structure):
            out.append(t.__name__)
    return tuple(out)


def _fields(struct: type, base: int = 0) -> list[tuple[str, int, tuple[tuple[str, int], ...]]]:
    out = []
    for f in getattr(struct, "_fields_", ()):
        offset = base + getattr(struct, f[0]).offset
        nested = isinstance(f[1], type) and issubclass(f[1], (ctypes.Structure, ctypes.Union))
        members = tuple((name, off) for name, off, _ in _fields(f[1], offset)) if nested else ()
        out.append((f[0], offset, members))
    return out


def read_binding(tree: Path, module: str = "llama_cpp.llama_cpp") -> Declarations:
    """The declarations in the source tree's binding, read with a recording stand-in for the library."""
    package = tree / "llama_cpp"
    if not (package / "_ctypes_extensions.py").is_file():
        raise SystemExit(f"error: {tree}: no llama_cpp/_ctypes_extensions.py (not a llama-cpp-python source tree)")
    saved = {k: v for k, v in sys.modules.items() if k == "llama_cpp" or k.startswith("llama_cpp.")}
    for k in saved:
        del sys.modules[k]
    # The package without its __init__ (which would load the real library through every module).
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(package)]  # type: ignore[attr-defined]
    sys.modules["llama_cpp"] = pkg
    library = _Library()
    try:
        ext = importlib.import_module("llama_cpp._ctypes_extensions")
        ext.load_shared_library = lambda *_a, **_k: library  # type: ignore[attr-defined]
        mod = importlib.import_module(module)
    finally:
        for k in [k for k in sys.modules if k == "llama_cpp" or k.startswith("llama_cpp.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    functions = tuple(Function(r.c_name, abi_class(r.restype), tuple(abi_class(a) for a in r.argtypes),
                               _struct_names([r.restype, *r.argtypes]))
                      for r in library.seen.values())
    structs = []
    for name, value in vars(mod).items():
        if isinstance(value, type) and issubclass(value, ctypes.Structure) and value.__module__ == mod.__name__ and name == value.__name__:
            structs.append(Struct(name, ctypes.sizeof(value), tuple(_fields(value))))
    constants = tuple((name, value) for name, value in vars(mod).items()
                      if re.fullmatch(r"(LLAMA|GGML)_[A-Z0-9_]+", name) and isinstance(value, int) and not isinstance(value, bool))
    return Declarations(functions, tuple(structs), constants)


def _struct_bodies(header: str) -> dict[str, str]:
    """struct name -> its body's text, for the structs the headers define."""
    out = {}
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{", header):
        depth, i = 1, m.end()
        while depth and i < len(header):
            depth += {"{": 1, "}": -1}.get(header[i], 0)
            i += 1
        out[m.group(1)] = header[m.end():i - 1]
    return out


_PRELUDE = """#include <cstddef>
#include <type_traits>
#include "llama.h"
struct Abi { char k; std::size_t n; };
template <class T> constexpr Abi abi() {
    if constexpr (std::is_void_v<T>) return {'v', 0};
    else if constexpr (std::is_pointer_v<T>) return {'p', sizeof(T)};
    else if constexpr (std::is_floating_point_v<T>) return {'f', sizeof(T)};
    else if constexpr (std::is_class_v<T> || std::is_union_v<T>) return {'s', sizeof(T)};
    else return {'i', sizeof(T)};
}
template <class F> struct Sig;
template <class R, class... P> struct Sig<R(P...)> {
    static constexpr std::size_t n = sizeof...(P);
    static constexpr Abi ret = abi<R>();
    static constexpr Abi args[sizeof...(P) + 1] = {abi<P>()..., Abi{'-', 0}};
};
constexpr bool is(Abi a, char k, std::size_t n) { return a.k == k && a.n == n; }
"""

_KIND = {"v": "void", "p": "a pointer", "f": "a float", "s": "a struct", "i": "an integer"}


def _say(a: tuple[str, int]) -> str:
    k, n = a
    return _KIND[k] if k in "vp" else f"{_KIND[k]} of {n} bytes"


def check_source(decl: Declarations, header: str) -> tuple[str, list[str]]:
    """The C++ that checks `decl` against the headers, and the mismatches found without compiling
    (a declared function or struct the headers lack)."""
    problems = []
    lines = [_PRELUDE]
    for f in decl.functions:
        if not re.search(rf"\b{re.escape(f.name)}\s*\(", header):
            problems.append(f"{f.name}: declared by the binding, missing from llama.h")
            continue
        sig = f"Sig<decltype({f.name})>"
        lines.append(f'static_assert({sig}::n == {len(f.args)}, "{f.name}: the binding passes {len(f.args)} arguments");')
        lines.append(f'static_assert(is({sig}::ret, \'{f.ret[0]}\', {f.ret[1]}), "{f.name}: the binding expects {_say(f.ret)} back");')
        for i, a in enumerate(f.args):
            lines.append(f'static_assert({sig}::n != {len(f.args)} || is({sig}::args[{i}], \'{a[0]}\', {a[1]}), '
                         f'"{f.name}: the binding passes argument {i + 1} as {_say(a)}");')
    bodies = _struct_bodies(header)
    for s in decl.structs:
        if s.name not in bodies:
            continue  # a helper of the binding's own (an anonymous union's stand-in), not a C struct
        lines.append(f'static_assert(sizeof({s.name}) == {s.size}, "struct {s.name}: the binding\'s is {s.size} bytes");')
        for field, offset, members in s.fields:
            named = re.search(rf"\b{re.escape(field)}\b", bodies[s.name])
            if not named and members and all(re.search(rf"\b{re.escape(m)}\b", bodies[s.name]) for m, _ in members):
                pairs = members  # C declares it anonymous: its members are the struct's
            elif named:
                pairs = ((field, offset),)
            else:
                problems.append(f"struct {s.name}: the binding has a field {field!r} that llama.h does not")
                continue
            for name, at in pairs:
                lines.append(f'static_assert(offsetof({s.name}, {name}) == {at}, "struct {s.name}: the binding puts {name} at byte {at}");')
    for name, value in decl.constants:
        if re.search(rf"#define\s+{name}\b|\b{name}\s*(=[^=]|,|\n\s*}})", header):  # a macro or an enum member
            lines.append(f'static_assert((long long)({name}) == {value}LL, "{name}: the binding says {value}");')
    return "\n".join(lines) + "\n", problems


def compile_check(source: str, includes: list[Path], compiler: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="llama-abi-") as tmp:
        path = Path(tmp) / "abi.cpp"
        path.write_text(source)
        cmd = [compiler, "-std=c++17", "-fsyntax-only", "-w", "-fmax-errors=0", *(f"-I{p}" for p in includes), str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode == 0:
        return []
    found = re.findall(r"static assertion failed: (.*)", done.stderr)
    if found:
        return found
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    return errors or [done.stderr.strip() or f"{compiler} failed ({done.returncode})"]


def used_names(roots: list[Path]) -> set[str]:
    """What the appliance's code takes from the binding (`L.name` after `import llama_cpp as L`)."""
    names: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            names.update(re.findall(r"\bL\.(\w+)", path.read_text(errors="replace")))
    return names


def subject(problem: str) -> str:
    """The function, struct or constant a mismatch is about."""
    return problem.split(":", 1)[0].removeprefix("struct ").strip()


def matters(problem: str, decl: Declarations, used: set[str]) -> bool:
    name = subject(problem)
    if name in used:
        return True
    return any(name in f.structs for f in decl.functions if f.name in used)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tree", type=Path, help="a llama-cpp-python source tree, its llama.cpp in vendor/llama.cpp")
    p.add_argument("--uses", type=Path, action="append", default=[],
                   help="code whose uses of the binding must match (default: this project's engines/ and appliance/); "
                        "a mismatch elsewhere is a warning")
    args = p.parse_args(argv)
    tree: Path = args.tree
    llama = tree / "vendor" / "llama.cpp"
    header_path = llama / "include" / "llama.h"
    if not header_path.is_file():
        print(f"error: {header_path}: missing", file=sys.stderr)
        return 2
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        print("error: no C++ compiler (c++, g++ or clang++) on PATH to check the binding with", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[1]
    used = used_names(args.uses or [root / "engines", root / "appliance"])
    decl = read_binding(tree)
    header = header_path.read_text()
    source, problems = check_source(decl, header)
    problems += compile_check(source, [llama / "include", llama / "ggml" / "include"], compiler)
    failing = [x for x in problems if matters(x, decl, used)]
    for x in problems:
        if x not in failing:
            print(f"warning: {x} (the appliance does not use it)", file=sys.stderr)
    if failing:
        print(f"error: llama-cpp-python's ctypes declarations ({tree.name}) do not match {header_path}:", file=sys.stderr)
        for x in failing:
            print(f"  {x}", file=sys.stderr)
        return 1
    print(f"the binding matches llama.h: {len(decl.functions)} functions, {source.count('static_assert(sizeof(')} structs "
          f"and {source.count('static_assert((long long)')} constants checked; {len(problems)} mismatches, none in what the appliance uses")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
