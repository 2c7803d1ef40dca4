"""The decoder stack's structs as C lays them out against the ctypes mirrors Python passes to it.

offload/cpu/leanstack.py declares `_Seg`, `_Layer`, `_LaneT` and `_Dims` by hand, field for field
after kernels/decode_stack.h's seg_t, layer_t, lane_t and dims_t; a field added, dropped, moved or
retyped on one side only would have the C read the wrong bytes and nothing else would notice. What
must hold: the same field names in the same order (read from the header), and for every field the
C compiler's offsetof, sizeof and kind (float, int32, int64, other) equal to ctypes' `.offset`,
`.size` and type, each struct's sizeof and alignment too, measured by a tiny C program the system
compiler builds from the header; decode_stack_lanes' parameters as the header declares them are
the argtypes leanstack gives it, and ROWWISE is the header's. Every header the kernel sources
include is in ggml_kernel.HEADERS, so editing one rebuilds the cached library. The last tests show
the checks fail on a moved field, a retyped field and a field the Python side lacks.
"""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess

import pytest

from offload.cpu import ggml_kernel, leanstack

KERNELS = ggml_kernel.SOURCE.parent
HEADER = KERNELS / "decode_stack.h"
MIRRORS = {"seg_t": leanstack._Seg, "layer_t": leanstack._Layer, "lane_t": leanstack._LaneT, "dims_t": leanstack._Dims}
KIND = {ctypes.c_float: "f32", ctypes.c_int32: "i32", ctypes.c_int64: "i64"}  # any other ctype: "other"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def _code(text: str) -> str:
    """C text without its comments."""
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def header_fields(text: str) -> dict[str, list[str]]:
    """struct name -> its field names in order, from the `typedef struct { ... } NAME;` blocks of C `text`."""
    out = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", _code(text), flags=re.S):
        names = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            for part in decl.split(","):  # `const float *attn_norm, *ffn_norm`: each declarator's name
                names.append(re.findall(r"(\w+)\s*(?:\[\s*\d+\s*\])?\s*$", part.strip())[0])
        out[name] = names
    return out


def _program(mirrors: dict) -> str:
    """A C program printing, as JSON, sizeof/alignment of each struct and offsetof/sizeof/kind of each
    field ctypes names (a name C lacks is a compile error)."""
    lines = [
        "#include <stdalign.h>",
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "decode_stack.h"',
        '#define KIND(e) _Generic((e), float: "f32", int32_t: "i32", int64_t: "i64", default: "other")',
        "int main(void) {",
        '    printf("{");',
    ]
    for i, (c_name, cls) in enumerate(mirrors.items()):
        sep = "," if i else ""
        lines.append(
            f'    printf("{sep}\\"{c_name}\\": {{\\"size\\": %zu, \\"align\\": %zu, \\"fields\\": [", '
            f"sizeof({c_name}), alignof({c_name}));"
        )
        for j, (f, *_) in enumerate(cls._fields_):
            fsep = "," if j else ""
            lines.append(
                f'    printf("{fsep}[\\"{f}\\", %zu, %zu, \\"%s\\"]", offsetof({c_name}, {f}), '
                f"sizeof((({c_name} *)0)->{f}), KIND((({c_name} *)0)->{f}));"
            )
        lines.append('    printf("]}");')
    lines += ['    printf("}\\n");', "    return 0;", "}"]
    return "\n".join(lines) + "\n"


def c_layouts(tmp_path, mirrors: dict = MIRRORS) -> dict:
    """What the system C compiler makes of decode_stack.h, for the fields `mirrors` names."""
    src, exe = tmp_path / "layouts.c", tmp_path / "layouts"
    src.write_text(_program(mirrors))
    done = subprocess.run(
        [CC, "-std=c11", "-I", str(KERNELS), "-o", str(exe), str(src)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise AssertionError(f"the layout program does not compile against decode_stack.h:\n{done.stderr}")
    return json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)


def py_layouts(mirrors: dict = MIRRORS) -> dict:
    """The same numbers from the ctypes structures."""
    out = {}
    for c_name, cls in mirrors.items():
        fields = [[f, getattr(cls, f).offset, getattr(cls, f).size, KIND.get(t, "other")] for f, t in cls._fields_]
        out[c_name] = {"size": ctypes.sizeof(cls), "align": ctypes.alignment(cls), "fields": fields}
    return out


@needs_cc
def test_ctypes_mirrors_have_the_headers_fields_in_order():
    fields = header_fields(HEADER.read_text())
    assert {n: fields[n] for n in MIRRORS} == {n: [f for f, *_ in cls._fields_] for n, cls in MIRRORS.items()}


@needs_cc
def test_every_offset_size_and_kind_equals_the_c_compilers(tmp_path):
    c, py = c_layouts(tmp_path), py_layouts()
    for name in MIRRORS:
        assert py[name] == c[name], f"{name}: ctypes {py[name]} != C {c[name]}"


def test_decode_stack_lanes_arguments_and_flags_are_the_headers():
    """The prototype's parameters (pointer -> c_void_p, int64_t -> c_int64, int -> c_int) are the argtypes
    leanstack sets, and leanstack.ROWWISE and the activations (dims_t.act) are the header's."""
    code = _code(HEADER.read_text())
    params = re.search(r"int\s+decode_stack_lanes\s*\((.*?)\)\s*;", code, flags=re.S).group(1).split(",")
    want = [
        ctypes.c_void_p if "*" in p else ctypes.c_int64 if "int64_t" in p else ctypes.c_int
        for p in (" ".join(q.split()) for q in params)
    ]
    fn = leanstack._function()
    if fn is None:
        pytest.skip("the GGUF kernel library is not built")
    assert fn.argtypes == want
    assert int(re.search(r"#define\s+ROWWISE\s+(\d+)", code).group(1)) == leanstack.ROWWISE
    acts = {name: int(v) for name, v in re.findall(r"#define\s+(ACT_\w+)\s+(\d+)", code)}
    assert acts == {"ACT_SILU": leanstack.ACT_SILU, "ACT_GELU_TANH": leanstack.ACT_GELU_TANH}


def test_every_included_header_is_part_of_the_build_hash():
    """A header left out of ggml_kernel.HEADERS could change without rebuilding the cached library."""
    files = [*ggml_kernel.sources_of(ggml_kernel.SOURCE), *(KERNELS / h for h in ggml_kernel.HEADERS)]
    included = {h for f in files for h in re.findall(r'#include\s+"([^"]+)"', f.read_text())}
    assert included <= set(ggml_kernel.HEADERS), included - set(ggml_kernel.HEADERS)


# The checks above can fail: a struct whose fields moved, one retyped, one the Python side lacks.


class _Moved(ctypes.Structure):  # seg_t with `type` and `rows` swapped
    _fields_ = [("w", ctypes.c_void_p), ("map", ctypes.c_void_p), ("rows", ctypes.c_int64), ("type", ctypes.c_int32)]


class _Retyped(ctypes.Structure):  # dims_t with eps as a double
    _fields_ = [*leanstack._Dims._fields_[:5], ("eps", ctypes.c_double), ("scale", ctypes.c_float)]


@needs_cc
@pytest.mark.parametrize("c_name, cls", [("seg_t", _Moved), ("dims_t", _Retyped)])
def test_a_moved_or_retyped_field_is_caught(tmp_path, c_name, cls):
    assert c_layouts(tmp_path, {c_name: cls})[c_name] != py_layouts({c_name: cls})[c_name]


def test_a_field_the_python_side_lacks_is_caught():
    text = HEADER.read_text().replace("int64_t mask_cols;", "int64_t mask_cols;\n    int32_t spare;", 1)
    assert header_fields(text)["lane_t"] != [f for f, *_ in leanstack._LaneT._fields_]
    assert header_fields(text)["lane_t"][-1] == "spare"


def test_kernel_block_sizes_are_the_formats():
    """The CPU runtime states the ggml block sizes it reads itself (offload/cpu never imports formats/):
    every GGUF type it serves has formats/gguf_quants.BLOCK's (values, bytes), and Q8A reads Q8_0's."""
    from offload.formats.gguf_quants import BLOCK, Q8_0

    gguf_types = [t for t in ggml_kernel.QTYPES if t not in (ggml_kernel.SX3, ggml_kernel.SX2, ggml_kernel.Q8A)]
    assert gguf_types and all(ggml_kernel.BLOCKS[t] == BLOCK[t] for t in gguf_types)
    assert ggml_kernel.BLOCKS[ggml_kernel.Q8A] == BLOCK[Q8_0]
