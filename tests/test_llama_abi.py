"""installer/llama_abi.py: the binding's ctypes declarations checked against llama.h by the C++
compiler, on a small source tree shaped like llama-cpp-python's (its real `_ctypes_extensions.py`,
a binding and a header written here), so each kind of mismatch is produced on purpose."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "installer" / "llama_abi.py"

pytestmark = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="no C++ compiler")

BINDING = '''
import ctypes, pathlib
from llama_cpp._ctypes_extensions import load_shared_library, ctypes_function_for_shared_library
_lib = load_shared_library("llama", pathlib.Path(__file__).parent / "lib")
ctypes_function = ctypes_function_for_shared_library(_lib)

LLAMA_TOKEN_ATTR_CONTROL = 8
llama_token = ctypes.c_int32

class llama_token_data(ctypes.Structure):
    _fields_ = [("id", llama_token), ("logit", ctypes.c_float), ("p", ctypes.c_float)]

class llama_override_value(ctypes.Union):
    _fields_ = [("val_i64", ctypes.c_int64), ("val_f64", ctypes.c_double)]

class llama_override(ctypes.Structure):  # C's union is anonymous; the binding names it
    _fields_ = [("tag", ctypes.c_int), ("value", llama_override_value)]

@ctypes_function("llama_tokenize", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(llama_token),
                                    ctypes.c_int32, ctypes.c_bool, ctypes.c_bool], ctypes.c_int32)
def llama_tokenize(vocab, text, text_len, tokens, n_tokens_max, add_special, parse_special): ...

@ctypes_function("llama_sampler_apply", [ctypes.c_void_p, ctypes.POINTER(llama_token_data)], None)
def llama_sampler_apply(smpl, cur_p): ...

@ctypes_function("llama_opt_epoch", [ctypes.c_int64], None)
def llama_opt_epoch(x): ...
'''

HEADER = '''#pragma once
#include <stdint.h>
#include <stdbool.h>
#ifdef __cplusplus
extern "C" {
#endif
struct llama_vocab;
struct llama_sampler;
typedef int32_t llama_token;
typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;
struct llama_override {
    int tag;
    union {
        int64_t val_i64;
        double  val_f64;
    };
};
enum llama_token_attr {
    LLAMA_TOKEN_ATTR_NORMAL  = 1 << 2,
    LLAMA_TOKEN_ATTR_CONTROL = 1 << 3,
};
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len, llama_token * tokens,
                       int32_t n_tokens_max, bool add_special, bool parse_special);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data * cur_p);
void llama_opt_epoch(int32_t x);
#ifdef __cplusplus
}
#endif
'''

USES = "L.llama_tokenize(...)\nL.llama_sampler_apply(...)\nL.LLAMA_TOKEN_ATTR_CONTROL\nL.llama_override()\n"


def _tree(tmp_path: Path, header: str = HEADER, binding: str = BINDING) -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.submodule_search_locations
    installed = Path(next(iter(spec.submodule_search_locations)))
    tree = tmp_path / "llama_cpp_python-0.0.0"
    (tree / "llama_cpp").mkdir(parents=True)
    shutil.copy(installed / "_ctypes_extensions.py", tree / "llama_cpp" / "_ctypes_extensions.py")
    (tree / "llama_cpp" / "llama_cpp.py").write_text(binding)
    (tree / "vendor" / "llama.cpp" / "include").mkdir(parents=True)
    (tree / "vendor" / "llama.cpp" / "include" / "llama.h").write_text(header)
    (tmp_path / "uses").mkdir()
    (tmp_path / "uses" / "engine.py").write_text(USES)
    return tree


def _check(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), str(tree), "--uses", str(tree.parent / "uses")],
                          capture_output=True, text=True, timeout=120)


def test_a_matching_binding_passes_and_an_unused_mismatch_is_only_a_warning(tmp_path: Path) -> None:
    done = _check(_tree(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "3 functions, 2 structs" in done.stdout
    assert "warning: llama_opt_epoch: the binding passes argument 1 as an integer of 8 bytes (the appliance does not use it)" in done.stderr


@pytest.mark.parametrize(("change", "message"), [
    (("int32_t text_len", "int64_t text_len"), "llama_tokenize: the binding passes argument 3 as an integer of 4 bytes"),
    (("bool parse_special);", "bool parse_special, int32_t more);"), "llama_tokenize: the binding passes 7 arguments"),
    (("const char * text,", "float text,"), "llama_tokenize: the binding passes argument 2 as a pointer"),
    (("    float logit;\n    float p;", "    float p;\n    float logit;"), "struct llama_token_data: the binding puts logit at byte 4"),
    (("    float p;\n} llama_token_data;", "    float p;\n    int32_t extra;\n} llama_token_data;"),
     "struct llama_token_data: the binding's is 12 bytes"),
    (("LLAMA_TOKEN_ATTR_CONTROL = 1 << 3", "LLAMA_TOKEN_ATTR_CONTROL = 1 << 4"), "LLAMA_TOKEN_ATTR_CONTROL: the binding says 8"),
    (("void llama_sampler_apply(", "void llama_sampler_apply_v2("), "llama_sampler_apply: declared by the binding, missing from llama.h"),
    (("        double  val_f64;\n", "        float   val_f32;\n"), "struct llama_override: the binding has a field 'value'"),
])
def test_a_mismatch_in_what_the_appliance_uses_fails_the_build_naming_it(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    old, new = change
    assert old in HEADER
    done = _check(_tree(tmp_path, header=HEADER.replace(old, new)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "do not match" in done.stderr
    assert message in done.stderr


def test_not_a_source_tree_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "llama.h: missing" in done.stderr
