"""Jinja rendering of kernel templates; the check of a plan's declared kernels against the rendered
`extern "C"` signatures; the hashes that make tuned entries go stale."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache

import jinja2
from jinja2 import meta

from .config import templates_dir
from .spec import Plan, kernel_base_name, kernel_name

#: <repo>/templates in a checkout, the wheel's packaged copy (pairgen/_templates) when installed.
TEMPLATES_DIR = templates_dir()

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,
)


@dataclass(frozen=True)
class Rendered:
    source: str
    template: str
    template_sha256: str
    kernel_name: str

    @property
    def source_sha256(self) -> str:
        """What a tuned entry records: it is stale when today's code renders another source."""
        return source_hash(self.source)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def source_hash_as_tuned(rendered: Rendered, tuned_template_sha256: str, tuned_params: dict | None = None) -> str:
    """The hash today's source would have had when the template files hashed to
    tuned_template_sha256 and the point was written as tuned_params (what an entry records). The
    header's first two lines name both, comments the compiler never sees: an edit elsewhere in the
    template tree that leaves a variant's code as it was (code for other variants, behind a jinja
    condition) changes only the first, and a parameter added since, at the value that reproduces
    the old kernel (OpSpec.added_params), only the second."""
    first, newline, rest = rendered.source.partition("\n")
    then = first.replace(f"(sha256 {rendered.template_sha256[:16]})", f"(sha256 {tuned_template_sha256[:16]})", 1)
    if tuned_params is not None and rest.startswith("// params "):
        _, params_end, after = rest.partition("\n")
        rest = f"// params {json.dumps(tuned_params, sort_keys=True)}" + params_end + after
    return source_hash(then + newline + rest)


def hashes_as_tuned(rendered: Rendered, entry: dict):
    """Every hash today's source of an entry's variant may have been recorded under and still be
    the kernel it was measured with, most likely first (a generator: a caller stops at a match):
    today's; as rendered under the entry's template hash and parameters (source_hash_as_tuned); and
    each of those with the kernels named as they were before names carried the variant, or as the
    entry's point named them before parameters were added to it (the names are symbols, not code)."""
    op, strategy = rendered.template.removesuffix(".cu.j2").split("/")
    names = [kernel_base_name(op, strategy)]
    if "params" in entry and "dtype" in entry.get("key", {}):
        names.append(kernel_name(op, strategy, entry["key"]["dtype"], entry["params"]))
    renamed = [Rendered(rendered.source.replace(rendered.kernel_name, name), rendered.template,
                        rendered.template_sha256, name) for name in names if name != rendered.kernel_name]
    for source in (rendered, *renamed):
        yield source.source_sha256
        yield source_hash_as_tuned(source, entry["template_sha256"])
        yield source_hash_as_tuned(source, entry["template_sha256"], entry["params"])


def template_name(op: str, strategy: str) -> str:
    return f"{op}/{strategy}.cu.j2"


def _referenced(name: str) -> set[str]:
    """The template and everything it includes, extends or imports, recursively."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        source = _env.loader.get_source(_env, current)[0]
        todo.extend(n for n in meta.find_referenced_templates(_env.parse(source)) if n)
    return seen


@lru_cache(maxsize=None)
def template_hash(op: str, strategy: str) -> str:
    """sha256 over a strategy's template and every file it pulls in (name and text)."""
    digest = hashlib.sha256()
    for name in sorted(_referenced(template_name(op, strategy))):
        digest.update(name.encode() + b"\0" + (TEMPLATES_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()


def render_template(op: str, strategy: str, params: dict, widths: dict, context: dict,
                    precision: str = "float32", name_of_kernel: str | None = None) -> Rendered:
    """Render with a context already derived by the op (templates only substitute and unroll).
    name_of_kernel: the main kernel's name (a plan's carries its variant: spec.kernel_name; by
    default the strategy's own, kernel_base_name)."""
    name = template_name(op, strategy)
    sha = template_hash(op, strategy)
    header = (
        f"// pairgen: template {name} (sha256 {sha[:16]}), strategy {strategy}\n"
        f"// params {json.dumps(params, sort_keys=True)}\n"
        f"// widths {json.dumps(widths, sort_keys=True)}"
        + ("" if precision == "float32" else f"\n// precision {precision}")
    )
    kname = name_of_kernel or kernel_base_name(op, strategy)
    source = _env.get_template(name).render(header=header, kernel_name=kname, **context)
    return Rendered(source=source, template=name, template_sha256=sha, kernel_name=kname)


def render_plan(plan: Plan) -> Rendered:
    """A plan's source, checked against the kernels the plan declares."""
    rendered = render_template(plan.op, plan.strategy, plan.params, plan.widths, plan.context, plan.precision,
                               plan.kernel_name or None)
    check_contract(plan, rendered.source)
    return rendered


class ContractError(ValueError):
    """A plan's declared kernels disagree with its rendered source's `extern "C"` signatures."""


_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                     r'(\w+)\s*\(([^)]*)\)', re.S)
_WORD = re.compile(r"\w+")
_I64 = re.compile(r"\b(i64|int64_t|long\s+long|long)\b")


def _arg_kind(declaration: str) -> str:
    """'const float* __restrict__ x' -> ptr; 'int B' -> i32; 'i64 N' -> i64 (pairgen.cuh's alias)."""
    if "*" in declaration:
        return "ptr"
    if _I64.search(declaration):
        return "i64"
    if re.search(r"\b(int|int32_t|unsigned)\b", declaration):
        return "i32"
    return f"unsupported({declaration.strip()})"


def named_signatures(source: str) -> dict[str, tuple[str, ...]]:
    """The arguments, as "kind name", of every `extern "C" __global__` function of a rendered
    source ('const float* __restrict__ x' -> "ptr x")."""
    found = {}
    for match in _KERNEL.finditer(source):
        args = [a for a in match.group(2).split(",") if a.strip()]
        found[match.group(1)] = tuple(f"{_arg_kind(a)} {_WORD.findall(a)[-1]}" for a in args)
    return found


def signatures(source: str) -> dict[str, tuple[str, ...]]:
    """The argument kinds of every `extern "C" __global__` function of a rendered source."""
    return {name: tuple(a.split()[0] for a in args) for name, args in named_signatures(source).items()}


def check_contract(plan: Plan, source: str) -> None:
    """Every kernel the plan declares is in the source with the declared arguments, kinds and
    names, in order; a mismatch names the template, the kernel and both signatures."""
    found = named_signatures(source)
    for kernel in plan.kernels:
        if kernel.name not in found:
            raise ContractError(f"{template_name(plan.op, plan.strategy)}: the plan declares kernel {kernel.name}, "
                                f"which the rendered source does not define (it defines {sorted(found)})")
        if found[kernel.name] != tuple(kernel.args):
            raise ContractError(f"{template_name(plan.op, plan.strategy)}: kernel {kernel.name} takes "
                                f"({', '.join(found[kernel.name])}) in the source but the plan declares "
                                f"({', '.join(kernel.args)})")
