"""Jinja rendering of kernel templates, and the hashes that make tuned entries go stale."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache

import jinja2
from jinja2 import meta

from .config import REPO_ROOT

TEMPLATES_DIR = REPO_ROOT / "templates"

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


def kernel_name(op: str, strategy: str) -> str:
    return f"pairgen_{op}_{strategy}"


def render_template(op: str, strategy: str, params: dict, widths: dict, context: dict) -> Rendered:
    """Render with a context already derived by the op (templates only substitute and unroll)."""
    name = template_name(op, strategy)
    sha = template_hash(op, strategy)
    header = (
        f"// pairgen: template {name} (sha256 {sha[:16]}), strategy {strategy}\n"
        f"// params {json.dumps(params, sort_keys=True)}\n"
        f"// widths {json.dumps(widths, sort_keys=True)}"
    )
    kname = kernel_name(op, strategy)
    source = _env.get_template(name).render(header=header, kernel_name=kname, **context)
    return Rendered(source=source, template=name, template_sha256=sha, kernel_name=kname)


def render(op: str, strategy: str, params: dict, widths: dict) -> Rendered:
    """Render one point of an op's search space: returns the CUDA source and template hash."""
    from .ops import get_op

    spec = get_op(op)
    plan = spec.plan(strategy, params, widths)
    return render_template(op, strategy, plan.params, plan.widths, plan.context)
