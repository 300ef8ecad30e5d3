"""A rendered kernel source (CUDA C++ for NVRTC) as C++ for g++ on top of prelude.h: each inline-PTX
statement becomes a call of the emulator's function for that instruction, shared arrays become
per-block storage, and every __global__ function gets an exported launcher.

Only the PTX that pairgen's templates use is known; anything else is an error naming it, so a new
instruction in a template fails here loudly instead of being skipped."""
from __future__ import annotations

import re


class UnknownInstruction(ValueError):
    """An inline-PTX statement the emulator has no function for."""


def _skip_string(text: str, i: int) -> int:
    """The index after the string or character literal starting at text[i]."""
    quote = text[i]
    i += 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _matching_paren(text: str, i: int) -> int:
    """The index of the parenthesis closing the one at text[i]."""
    depth = 0
    while True:
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def _split_top(text: str, separator: str) -> list[str]:
    """text split at `separator` characters outside parentheses, brackets and literals."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


def _string_value(literals: str) -> str:
    """The value of adjacent C string literals (escapes \\n, \\t, \\", \\\\)."""
    out, i = [], 0
    while i < len(literals):
        if literals[i] == '"':
            end = _skip_string(literals, i)
            body = literals[i + 1:end - 1]
            out.append(body.encode().decode("unicode_escape"))
            i = end
        else:
            i += 1
    return "".join(out)


_OPERAND = re.compile(r'^\s*"([^"]*)"\s*\((.*)\)\s*$', re.S)


def _operands(section: str) -> list[tuple[str, str]]:
    if not section.strip():
        return []
    found = []
    for part in _split_top(section, ","):
        m = _OPERAND.match(part)
        if m is None:
            raise UnknownInstruction(f"cannot read the asm operand {part.strip()!r}")
        found.append((m.group(1), m.group(2).strip()))
    return found


def _normal(ptx: str) -> str:
    return re.sub(r"\s+", " ", ptx).strip()


#: One output from one input: the instruction's text -> the function computing it (prelude.h).
_UNARY = {"{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }": "pgx::smem_offset",
          "cvt.rn.bf16.f32 %0, %1;": "pgx::to_bf16", "cvt.rn.f16.f32 %0, %1;": "pgx::to_f16",
          "cvt.f32.f16 %0, %1;": "pgx::from_f16", "cvt.rna.tf32.f32 %0, %1;": "pgx::to_tf32_rna",
          "tanh.approx.f32 %0, %1;": "std::tanh", "max.NaN.f32 %0, %1, 0f00000000;": "pgx::relu_keeping_nan"}


def _ptx_call(ptx: str, outputs: list, inputs: list) -> str:
    """The C++ statement that does what the asm statement does."""
    ops = [e for _, e in outputs] + [e for _, e in inputs]
    text = _normal(ptx)
    o = lambda k: f"({ops[k]})"  # noqa: E731 - operand k as an expression
    if text == "":
        return "do {} while (0)"  # an empty asm pinning registers: nothing to do
    if text in ("fence.proxy.async.shared::cta;", "griddepcontrol.wait;", "griddepcontrol.launch_dependents;",
                "wgmma.fence.sync.aligned;"):
        return "do {} while (0)"
    if text == "cp.async.bulk.prefetch.L2.global [%0], %1;":
        return "do {} while (0)"  # a hint to L2: nothing to emulate
    if text == "wgmma.commit_group.sync.aligned;":
        return "pgx::wgmma_commit()"
    if re.fullmatch(r"wgmma\.wait_group\.sync\.aligned %0;", text):
        return f"pgx::wgmma_wait({o(0)})"
    if text == "cp.async.commit_group;":
        return "pgx::cp_async_commit()"
    if re.fullmatch(r"cp\.async\.wait_group %0;", text):
        return f"pgx::cp_async_wait({o(0)})"
    if m := re.fullmatch(r"cp\.async\.(?:cg|ca)\.shared\.global \[%0\], \[%1\], (\d+), %2;", text):
        return f"pgx::cp_async((unsigned){o(0)}, {o(1)}, {m.group(1)}, (int){o(2)})"
    if text == "mbarrier.init.shared::cta.b64 [%0], %1;":
        return f"pgx::mbarrier_init((unsigned){o(0)}, (int){o(1)})"
    if text == "mbarrier.arrive.shared::cta.b64 _, [%0];":
        return f"pgx::mbarrier_arrive((unsigned){o(0)})"
    if text == ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"):
        return f"{o(0)} = pgx::mbarrier_try_wait_parity((unsigned){o(1)}, (unsigned){o(2)})"
    if text == "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;":
        return f"pgx::mbarrier_arrive_expect_tx((unsigned){o(0)}, (unsigned){o(1)})"
    if text == "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];":
        return f"pgx::cp_async_bulk_to_shared((unsigned){o(0)}, {o(1)}, (unsigned){o(2)}, (unsigned){o(3)})"
    if text == "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;":
        return f"pgx::cp_async_bulk_to_global((void*){o(0)}, (unsigned){o(1)}, (unsigned){o(2)})"
    if text == "cp.async.bulk.commit_group;":
        return "pgx::cp_async_bulk_commit()"
    if re.fullmatch(r"cp\.async\.bulk\.wait_group(?:\.read)? %0;", text):
        return f"pgx::cp_async_bulk_wait({o(0)})"
    if text == "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];":
        return f"pgx::cp_async_mbarrier_arrive_noinc((unsigned){o(0)})"
    if m := re.fullmatch(r"bar\.sync (%0|\d+), (\d+);", text):
        barrier = o(0) if m.group(1) == "%0" else m.group(1)
        return f"pgx::bar_sync((int){barrier}, {m.group(2)})"
    if text == "st.global.v4.b32 [%0], { %1, %2, %3, %4 };":
        return (f"do {{ unsigned* pgx_p = (unsigned*){o(0)}; pgx_p[0] = {o(1)}; pgx_p[1] = {o(2)}; "
                f"pgx_p[2] = {o(3)}; pgx_p[3] = {o(4)}; }} while (0)")
    if text in _UNARY:
        return f"{o(0)} = {_UNARY[text]}({o(1)})"
    if m := re.fullmatch(r"cvt\.rn\.(bf16|f16)x2\.f32 %0, %1, %2;", text):
        convert = "pgx::to_bf16" if m.group(1) == "bf16" else "pgx::to_f16"
        return f"{o(0)} = ((unsigned){convert}({o(1)}) << 16) | (unsigned){convert}({o(2)})"
    if m := re.fullmatch(r"ldmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared\.b16 \{ ?%0, %1, %2, %3\}, \[%4\];", text):
        trans = "true" if m.group(1) else "false"
        return f"pgx::ldmatrix_x4({trans}, (unsigned){o(4)}, {o(0)}, {o(1)}, {o(2)}, {o(3)})"
    if m := re.fullmatch(r"stmatrix\.sync\.aligned\.m8n8\.x4(\.trans)?\.shared\.b16 \[%0\], \{ ?%1, %2, %3, %4 ?\};", text):
        trans = "true" if m.group(1) else "false"
        return f"pgx::stmatrix_x4({trans}, (unsigned){o(0)}, {o(1)}, {o(2)}, {o(3)}, {o(4)})"
    if m := re.fullmatch(r"mma\.sync\.aligned\.m16n8k(16|8)\.row\.col\.f32\.(bf16|f16|tf32)\.\2\.f32 "
                         r"\{ ?%0,%1,%2,%3\}, \{ ?%4,%5,%6,%7\}, \{ ?%8,%9\}, \{ ?%0,%1,%2,%3\};", text):
        kind = {"bf16": 0, "f16": 1, "tf32": 2}[m.group(2)]
        return (f"do {{ float* pgx_c[4] = {{&{o(0)}, &{o(1)}, &{o(2)}, &{o(3)}}}; "
                f"pgx::mma_sync<{kind}>(pgx_c, {o(4)}, {o(5)}, {o(6)}, {o(7)}, {o(8)}, {o(9)}); }} while (0)")
    if "wgmma.mma_async" in text:
        return _wgmma_call(text, o)
    raise UnknownInstruction(f"no emulation for the PTX {text!r}")


def _wgmma_call(text: str, o) -> str:
    m = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(bf16|f16)\.\2 \{ ([^}]*) \}, (.*);", text)
    if m is None:
        raise UnknownInstruction(f"no emulation for the wgmma {text!r}")
    n, kind = int(m.group(1)), {"bf16": 0, "f16": 1}[m.group(2)]
    accumulators = [int(a.strip().lstrip("%")) for a in m.group(3).split(",")]
    if accumulators != list(range(n // 2)):
        raise UnknownInstruction(f"wgmma accumulators not %0..%{n // 2 - 1}: {text!r}")
    rest = _split_top(m.group(4), ",")
    rest = [r.strip() for r in rest]
    if rest[0].startswith("{"):  # A from registers: its four words
        a_words = [o(int(r.strip().lstrip("%"))) for r in rest[0].strip("{} ").split(",")]
        a_decl, a_arg, desc_a = f"const unsigned pgx_a[4] = {{{', '.join(a_words)}}}; ", "pgx_a", "0ull"
        desc_b, flags = rest[1], rest[2:]
        expected_flags = ["p", "1", "1", "0"]
    else:
        a_decl, a_arg = "", "nullptr"
        desc_a, desc_b, flags = o(int(rest[0].lstrip("%"))), rest[1], rest[2:]
        expected_flags = ["p", "1", "1", "0", "0"]
    # B read N-major (imm-trans-b 1), emulated in the interleaved layout only (prelude.h)
    trans_b = int(flags[:-1] == expected_flags[:-1] and flags[-1] == "1")
    if flags != expected_flags and not trans_b:
        raise UnknownInstruction(f"wgmma with scale or transpose flags {flags} (emulated: {expected_flags}, "
                                 f"or the last 1): {text!r}")
    desc_b = o(int(desc_b.lstrip("%")))
    if s := re.search(r"setp\.eq\.u32 p, %(\d+), 0;", text):
        scale_d = f"((unsigned){o(int(s.group(1)))} == 0)"  # p: accumulate unless `first`
    elif "setp.ne.u32 p, 0, 0;" in text:
        scale_d = "0"
    else:
        raise UnknownInstruction(f"wgmma whose scale-d predicate is not read: {text!r}")
    pointers = ", ".join(f"&{o(k)}" for k in accumulators)
    return (f"do {{ float* const pgx_d[{n // 2}] = {{{pointers}}}; {a_decl}"
            f"pgx::wgmma<{n}, {kind}>(pgx_d, {a_arg}, {desc_a}, {desc_b}, {scale_d}, {trans_b}); }} while (0)")


_ASM = re.compile(r"\basm\b(\s+volatile\b)?\s*\(")


def _replace_asm(source: str) -> str:
    out, i = [], 0
    while m := _ASM.search(source, i):
        start, open_paren = m.start(), m.end() - 1
        close = _matching_paren(source, open_paren)
        sections = _split_top(source[open_paren + 1:close], ":")
        ptx = _string_value(sections[0])
        outputs = _operands(sections[1]) if len(sections) > 1 else []
        inputs = _operands(sections[2]) if len(sections) > 2 else []
        out.append(source[i:start])
        out.append(_ptx_call(ptx, outputs, inputs))
        i = close + 1
    out.append(source[i:])
    return "".join(out)


_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w\s]+?)\s+(\w+)\s*\[\s*\]\s*;")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')


def kernel_names(source: str) -> list[str]:
    return _KERNEL.findall(source)


#: Grids up to this size run all their blocks at once (a grid-wide barrier needs them together).
TOGETHER = 16

#: cuLaunchKernel's signature over a kernel's pgx_launch_ function (the CUfunction handle an
#: EmulatedKernel gives): what pairgen's compiled replays (pairgen/native/fastcall.cpp) call. It
#: reads the arguments from params[0] on as one array, which is how fastcall.cpp writes them, and
#: runs the threads in order.
DRIVER_LAUNCH = """
extern "C" __attribute__((visibility("default"))) int pgx_driver_launch(void* f, unsigned grid, unsigned, unsigned,
        unsigned threads, unsigned, unsigned, unsigned smem, void*, void** params, void**) {
    using Launcher = int (*)(unsigned, unsigned, unsigned, const long long*, int, int, char*, int);
    char error[1024];
    return reinterpret_cast<Launcher>(f)(grid, threads, smem, static_cast<const long long*>(params[0]), 0, TOGETHER,
                                         error, static_cast<int>(sizeof error));
}
"""


def translate(source: str) -> str:
    """The C++ for g++ (after prelude.h) of a rendered kernel source, with a launcher
    `pgx_launch_<kernel>` per __global__ function."""
    names = kernel_names(source)
    text = _replace_asm(source)
    text = _EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(pgx::dynamic_smem());",
                              text)
    text = re.sub(r"\b__shared__\s+__align__\((\d+)\)", r"alignas(\1) static thread_local", text)
    text = re.sub(r"\b__shared__\b", "static thread_local", text)
    launchers = [
        f'extern "C" __attribute__((visibility("default"))) int pgx_launch_{name}(unsigned grid, unsigned threads, '
        f"unsigned smem, const long long* args, int order, int together, char* error, int error_bytes) {{\n"
        f"    return pgx::launch(&{name}, grid, threads, smem, args, order, together, error, error_bytes);\n}}"
        for name in names]
    return text + "\n\n" + "\n".join(launchers) + "\n" + DRIVER_LAUNCH.replace("TOGETHER", str(TOGETHER))
