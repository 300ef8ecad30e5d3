"""The precisions pairgen computes in, as one table: every name and alias pairgen accepts, what
each means (torch dtypes, tensor cores, the templates' MMA kind) and how each part of pairgen
spells it. Imports no torch: the spec and the tuned database read it where torch is absent; the
torch dtypes are looked up when first asked for (the `dtype` properties, and the derived tables
at the end, resolved on first import by torch-side code).

| name (canonical) | aliases | a module's precision= / a closed form says | inputs and output | tensor-core operands |
| --- | --- | --- | --- | --- |
| float32 | ieee | ieee | float32 | — (FMA units, exact fp32) |
| tf32x3 | | tf32x3 | float32 | float32 rounded to TF32, three products |
| tf32 | | tf32 | float32 | float32 rounded to TF32 |
| bfloat16 | bf16 | bfloat16 | bfloat16 | bfloat16 |
| float16 | fp16 | float16 | float16 | float16 |

The canonical name is a tuned key's dtype, a Plan's precision and the key of an op's tolerance.
An fp32 module runs in float32, tf32x3 or tf32 as its precision= says; a 16-bit module, or an
fp32 module under torch.autocast, in bfloat16 or float16 (the dtype, `of_dtype`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    """One precision. `name` is canonical; `spelling` is what a module's precision= and a closed
    form's precision argument call it ("ieee" for exact fp32, else the name)."""
    name: str
    spelling: str
    storage: str            # torch dtype name of a call's inputs, parameters and output in it
    operand: str            # torch dtype name of the tensor-core operands (packed weights, staged inputs)
    tensor_cores: bool      # its kernels are mma.sync / wgmma ones
    mma_kind: int | None    # templates/common/mma.cuh.j2's MMA_KIND (None: no tensor cores)
    module_option: bool     # an fp32 module's precision= may name it
    closed_form: bool       # a closed form computes in it (ops/closed_form.py); tf32x3's split products do not pay there
    cuequivariance_fp32: str | None  # cuEquivariance's mode of the same accuracy for fp32 inputs (the bench's peer)
    short: str              # how a kernel's name spells it (spec.kernel_name)

    @property
    def half(self) -> bool:
        """16-bit inputs and operands."""
        return self.storage != "float32"

    @property
    def element_bytes(self) -> int:
        """Bytes per tensor-core operand element."""
        return 2 if self.half else 4

    @property
    def dtype(self):
        """The torch dtype of a call's inputs and output."""
        import torch

        return getattr(torch, self.storage)

    @property
    def operand_dtype(self):
        """The torch dtype of the tensor-core operands."""
        import torch

        return getattr(torch, self.operand)

    def __str__(self) -> str:
        return self.name


FLOAT32 = Precision("float32", "ieee", "float32", "float32", False, None, True, True, "ieee", "f32")
TF32X3 = Precision("tf32x3", "tf32x3", "float32", "float32", True, 3, True, False, "ieee", "tf32x3")
TF32 = Precision("tf32", "tf32", "float32", "float32", True, 2, True, True, None, "tf32")
BFLOAT16 = Precision("bfloat16", "bfloat16", "bfloat16", "bfloat16", True, 0, False, True, "bfloat16", "bf16")
FLOAT16 = Precision("float16", "float16", "float16", "float16", True, 1, False, True, None, "f16")

#: Every precision, in the order docs/ops.md lists them.
PRECISIONS = (FLOAT32, TF32X3, TF32, BFLOAT16, FLOAT16)
#: Canonical name -> precision.
BY_NAME = {p.name: p for p in PRECISIONS}
#: Every spelling pairgen accepts for a precision (case as written) -> the precision.
ALIASES = {"float32": FLOAT32, "ieee": FLOAT32, "tf32x3": TF32X3, "tf32": TF32, "bfloat16": BFLOAT16,
           "bf16": BFLOAT16, "float16": FLOAT16, "fp16": FLOAT16}
#: cuEquivariance's TriMulPrecision names that are not pairgen's (`triangle_multiplicative_update`
#: accepts them too, in any case): its default, exact fp32 for fp32 inputs.
CUEQUIVARIANCE_ALIASES = {"default": FLOAT32, "none": FLOAT32}


def lookup(name: "str | Precision") -> Precision:
    """The precision of a name or alias (ALIASES), or of a Precision; ValueError otherwise."""
    if isinstance(name, Precision):
        return name
    found = ALIASES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown precision {name!r}; pairgen knows {', '.join(map(repr, ALIASES))}")
    return found


# ---- the tables other modules read (torch-free) --------------------------------------------------

#: Precision -> the template's MMA_KIND, in the order the tensor-core strategies list them.
MMA_KINDS = {p.name: p.mma_kind for p in sorted((p for p in PRECISIONS if p.tensor_cores), key=lambda p: p.mma_kind)}
#: The 16-bit precisions.
HALF_PRECISIONS = tuple(p.name for p in PRECISIONS if p.half)
#: The precisions of fp32 inputs (exact fp32 first): what an fp32 module computes in.
FP32_PRECISIONS = tuple(p.name for p in PRECISIONS if not p.half)
#: What a module's precision= accepts (any alias of an fp32 precision) -> the spelling it keeps.
MODULE_OPTIONS = {alias: p.spelling for alias, p in ALIASES.items() if p.module_option}
#: A module's precision= spelling -> the precision (a tuned key's dtype) its fp32 calls compute in.
MODULE_PRECISIONS = {p.spelling: p.name for p in PRECISIONS if p.module_option}
#: The templates' storage kinds (fused elementwise kernels), by str(torch dtype).
STORAGE_KINDS = {f"torch.{p.storage}": p.storage for p in PRECISIONS if p.name == p.storage}


# ---- the tables torch-side code reads per call (dicts keyed as the hot paths need them) -----------

def _torch_tables() -> dict:
    import torch  # noqa: F401  (the dtype properties import it)

    storages = [p for p in PRECISIONS if p.name == p.storage]
    return {
        # 16-bit name -> torch dtype, and back (the dtype of a 16-bit module, or of an autocast)
        "HALF_DTYPES": {p.name: p.dtype for p in PRECISIONS if p.half},
        "HALF_BY_DTYPE": {p.dtype: p.name for p in PRECISIONS if p.half},
        # precision -> the dtype of the tensor-core kernels' operands / of a call's output
        "OPERAND_DTYPES": {name: BY_NAME[name].operand_dtype for name in MMA_KINDS},
        "OUTPUT_DTYPES": {p.name: p.dtype for p in PRECISIONS},
        # input dtypes the closed forms take; a closed form's precision spelling -> its compute dtype
        "CLOSED_FORM_DTYPES": tuple(p.dtype for p in storages),
        "COMPUTE_DTYPES": {p.spelling: p.dtype for p in PRECISIONS if p.closed_form},
    }


def __getattr__(name: str):
    if name in ("HALF_DTYPES", "HALF_BY_DTYPE", "OPERAND_DTYPES", "OUTPUT_DTYPES", "CLOSED_FORM_DTYPES",
                "COMPUTE_DTYPES"):
        tables = _torch_tables()
        globals().update(tables)
        return tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def of_dtype(dtype) -> "Precision | None":
    """The 16-bit precision of a torch dtype (a 16-bit module's, an autocast's), else None."""
    half_by_dtype = globals().get("HALF_BY_DTYPE") or __getattr__("HALF_BY_DTYPE")
    name = half_by_dtype.get(dtype)
    return None if name is None else BY_NAME[name]
