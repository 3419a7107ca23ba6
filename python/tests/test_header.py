"""The ctypes mirror against src/sparge.h: structure fields (names, types, order), enum values, the argument
counts of every bound function, and every function of the header bound but those torch makes unnecessary.
Needs the source tree and the library, not torch."""
import ctypes
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "src", "sparge.h")
sys.path.insert(0, os.path.join(HERE, ".."))

from sparge import _lib  # noqa: E402  (after the path set-up)

C_TYPES = {"void *": ctypes.c_void_p, "sparge_dtype": ctypes.c_int, "sparge_op": ctypes.c_int,
           "int64_t": ctypes.c_int64, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "double": ctypes.c_double,
           "float": ctypes.c_float}


def header_text():
    with open(HEADER) as f:
        text = f.read()
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments out


def c_struct_fields(text, name):
    """[(field, ctype)] of `typedef struct { ... } name;`, arrays as ctype * n."""
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + r";", text).group(1)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        m = re.match(r"(?:const\s+)?(\w+)\s+(.*)", decl)
        base, declarators = m.group(1), m.group(2)
        for d in (x.strip() for x in declarators.split(",")):
            pointer = d.startswith("*")
            d = d.lstrip("* ")
            array = re.match(r"(\w+)\[(\d+)\]", d)
            ctype = C_TYPES["void *" if pointer else base]
            if array:
                fields.append((array.group(1), ctype * int(array.group(2))))
            else:
                fields.append((d, ctype))
    return fields


def c_function_arity(text, name):
    m = re.search(r"\b" + name + r"\(([^)]*)\)\s*;", text)
    args = " ".join(m.group(1).split())
    return 0 if args in ("", "void") else args.count(",") + 1


@unittest.skipUnless(os.path.exists(HEADER), "skipped: src/sparge.h is not beside the python package")
class HeaderMirror(unittest.TestCase):
    def setUp(self):
        self.text = header_text()

    def test_structures(self):
        for name, cls in (("sparge_tensor", _lib.sparge_tensor), ("sparge_mask_params", _lib.sparge_mask_params),
                          ("sparge_mask_shape", _lib.sparge_mask_shape), ("sparge_mask_stats", _lib.sparge_mask_stats),
                          ("sparge_attn_params", _lib.sparge_attn_params),
                          ("sparge_mask_layout", _lib.sparge_mask_layout), ("sparge_op_desc", _lib.sparge_op_desc)):
            expected = c_struct_fields(self.text, name)
            got = list(cls._fields_)
            self.assertEqual([f for f, _ in got], [f for f, _ in expected], name)
            for (field, a), (_, b) in zip(got, expected):
                self.assertEqual(ctypes.sizeof(a), ctypes.sizeof(b), f"{name}.{field}")
                self.assertEqual(getattr(a, "_length_", None), getattr(b, "_length_", None), f"{name}.{field}")
                self.assertEqual(getattr(a, "_type_", a), getattr(b, "_type_", b), f"{name}.{field}")

    def test_enums(self):
        statuses = re.search(r"typedef enum \{([^}]*)\}\s*sparge_status;", self.text).group(1)
        names = [s.split("=")[0].strip() for s in statuses.split(",") if s.strip()]
        for value, name in enumerate(names):
            self.assertEqual(getattr(_lib, name[len("SPARGE_"):]), value, name)
            self.assertEqual(_lib.status_name(value), name)
        for name in ("F32", "F16", "BF16", "F64"):
            match = re.search(r"SPARGE_" + name + r"\s*=\s*(\d+)", self.text)
            if match is None and name == "F64":
                continue  # headers before SPARGE_F64 (fp64 tensors on cpu-ref)
            self.assertEqual(getattr(_lib, name), int(match.group(1)), name)
        ops = re.search(r"typedef enum \{([^}]*)\}\s*sparge_op;", self.text).group(1)
        names = [s.split("=")[0].strip() for s in ops.split(",") if s.strip()]
        for value, name in enumerate(names):
            self.assertEqual(getattr(_lib, name[len("SPARGE_"):]), value, name)
            if name != "SPARGE_OP_COUNT":
                self.assertTrue(_lib.lib.sparge_op_name(value).decode(), name)

    def test_functions(self):
        for name, (_, argtypes) in _lib._PROTOTYPES.items():
            self.assertEqual(len(argtypes), c_function_arity(self.text, name), name)
        declared = set(re.findall(r"\b(sparge_\w+)\(", self.text))
        self.assertFalse(set(_lib._PROTOTYPES) - declared, "bound but not in sparge.h")
        # torch owns the memory and the dtype conversions; nothing else of the header may go unbound.
        unbound = {"sparge_malloc", "sparge_free", "sparge_memcpy_to_device", "sparge_memcpy_to_host",
                   "sparge_memset", "sparge_f32_to_f16", "sparge_f16_to_f32", "sparge_f32_to_bf16",
                   "sparge_bf16_to_f32", "sparge_mask_export"}
        self.assertEqual(declared - set(_lib._PROTOTYPES), unbound, "declared in sparge.h but not bound")


if __name__ == "__main__":
    unittest.main()
