"""One anatomy of the model (issue 33): no module but ``paraxis.parallel.anatomy`` asks
the model for its embeddings, searches its tree for a list of layers, or matches the
names of a layer's parts. Reads the sources only (their syntax trees), so a copy of one
of these rules anywhere in packages/ or integrations/ fails here, naming the line.

A function may still walk ``named_modules()`` for what only a module's *type* or *plan
entry* says (a router class, a tensor-plan pattern); what it may not do is decide by a
name what part of the model a module is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for pattern in ("packages/*/src/**/*.py", "integrations/*/src/**/*.py")
                 for p in ROOT.glob(pattern))
# The one home of these rules; and paraxis-hf's plan reader, which supplies the plan the
# anatomy reads (transformers' own plan entries, matched as patterns, name the parts).
ALLOWED = {"packages/core/src/paraxis/parallel/anatomy.py",
           "integrations/hf/src/paraxis_hf/plan.py"}
EMBEDDING_GETTERS = {"get_output_embeddings", "get_input_embeddings"}
# Words that name a part of a transformer's layer or its ends in the module tree.
PART_WORDS = ("attn", "attention", "mlp", "experts", "mixer", "mamba", "lm_head",
              "embed_tokens", "layers", "norm")
MATCHERS = {"endswith", "startswith", "search", "match", "fullmatch", "fnmatch",
            "fnmatchcase", "compile"}


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _names_a_part(text: str) -> bool:
    return any(word in text.lower() for word in PART_WORDS) and len(text) < 200


def _findings(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in EMBEDDING_GETTERS:
            found.append((node.lineno, f"asks for {node.attr}"))
        elif isinstance(node, ast.Constant) and node.value in EMBEDDING_GETTERS:
            found.append((node.lineno, f"asks for {node.value}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "isinstance" and len(node.args) == 2 \
                and "ModuleList" in ast.unparse(node.args[1]):
            found.append((node.lineno, "searches for an nn.ModuleList"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MATCHERS \
                and any(_names_a_part(s) for a in node.args for s in _strings(a)):
            found.append((node.lineno, f"matches a part's name ({ast.unparse(node)[:80]})"))
        elif isinstance(node, ast.Compare) and any(
                _names_a_part(s) for s in _strings(node)
                if s in PART_WORDS or s.strip(".") in PART_WORDS):
            found.append((node.lineno, f"compares with a part's name ({ast.unparse(node)[:80]})"))
    return found


def test_only_the_anatomy_reads_the_models_parts():
    bad = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        if rel in ALLOWED:
            continue
        for line, what in _findings(ast.parse(path.read_text(), filename=rel)):
            bad.append(f"{rel}:{line}: {what}")
    assert not bad, "only paraxis.parallel.anatomy may do these:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "head = model.get_output_embeddings()",
    "lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]",
    "ok = isinstance(m, (nn.Linear, nn.ModuleList))",
    "attn = next(c for n, c in layer.named_children() if n.endswith(('attn', 'attention')))",
    "MIXERS = re.compile(r'(attn|mixer|mamba)$')",
    "experts = 'experts' in name.split('.')",
    "if name == 'lm_head': pass",
])
def test_the_scan_catches_each_kind_of_copy(source):
    """Planted: each rule written outside the anatomy is caught."""
    assert _findings(ast.parse(source)), source
