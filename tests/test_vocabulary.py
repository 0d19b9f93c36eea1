"""The vocabulary between processes is declared once: no label, CRD coordinate or shared metric name is respelled.

``daybreak.api.labels`` holds every key the processes match on (client-go's
``well_known_labels.go``), ``daybreak.api.metrics`` every metric name one
process writes and another reads. A string literal elsewhere in the product that
repeats one of them, as the whole string, as a ``key=value`` selector, or as a
segment of a REST path, is a second spelling that can drift: import the
constant instead. Docstrings and literals with a space (help texts, messages) are prose and are not checked; tests are not
checked (they pin the wire values on purpose). Like ``tests/test_layers.py``,
the checker also runs against a planted tree so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from test_layers import REPO, _modules

from daybreak.api import labels, metrics

VOCABULARY_MODULES = ("daybreak.api.labels", "daybreak.api.metrics")
# serving/router/ was being reworked on another branch when the names were folded: it still spells the vLLM
# gauges it reads and its held-requests gauge itself. Empty this once it imports daybreak.api.metrics.
NOT_YET: tuple[str, ...] = ()


def _pattern(word: str) -> re.Pattern[str]:
    """Where ``word`` counts as spelled out inside a longer literal."""
    if word in metrics.SHARED:  # a metric name, or one of its sample names, as a whole token
        return re.compile(rf"(?<![\w:]){re.escape(word)}(?:_total|_bucket|_sum|_count|_created)?(?![\w:])")
    if "/" in word:  # a label or annotation key, or group/version: as a whole token (``key=value``, a path)
        tail = "/" if word == labels.API_VERSION else ""
        return re.compile(rf"(?<![\w.-]){re.escape(word)}(?=$|[=,!\s){tail}])")
    if word == labels.GROUP:  # a prefix of other names too (``daybreak.dev/sunrise``): only the whole literal
        return re.compile(rf"^{re.escape(word)}$")
    # a bare plural: only as a whole literal or a path segment (``.../kvpools/...``)
    return re.compile(rf"(?:^|/){re.escape(word)}(?:/|$)")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def respelled(root: Path, vocabulary: frozenset[str]) -> list[str]:
    """``file:line: 'literal' spells 'word'`` for every literal outside the vocabulary module repeating a word."""
    patterns = {word: _pattern(word) for word in sorted(vocabulary)}
    out = []
    for module, path in _modules(root).items():
        if module in VOCABULARY_MODULES or module.startswith(NOT_YET):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in skip:
                continue
            if " " in node.value:  # prose: help texts, messages and hints name keys for a human reader
                continue
            for word, pattern in patterns.items():
                if pattern.search(node.value):
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r} spells {word!r}")
    return out


def test_the_vocabulary_is_spelled_once() -> None:
    found = respelled(REPO, labels.VOCABULARY | metrics.SHARED)
    assert not found, "import the constant from daybreak.api.labels or daybreak.api.metrics:\n" + "\n".join(found)


def test_the_checker_finds_planted_spellings(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.setuptools.package-dir]
        "daybreak" = "daybreak"
        "daybreak.api" = "api"
        "daybreak.operator" = "operator"
    """))
    files = {
        "daybreak/__init__.py": "",
        "api/__init__.py": "",
        "api/labels.py": "POOL = 'daybreak.dev/pool'\n",
        "operator/__init__.py": '"""Mentions daybreak.dev/pool and kvpools in prose: fine."""\n',
        "operator/a.py": "LABELS = {'daybreak.dev/pool': 'p'}\n",
        "operator/b.py": "def f(ns):\n    return f'/apis/daybreak.dev/v1alpha1/namespaces/{ns}/kvpools'\n",
        "operator/c.py": "SELECTOR = 'app.kubernetes.io/name=daybreak-agent'\nOTHER = 'daybreak.dev/pool-size'\n"
                         "GROUPS = ['daybreak.dev']\nWORD = 'kvpools are pools'\nHINT = 'kubectl get -l daybreak.dev/pool=p'\n"
                         "RESOURCE = 'daybreak.dev/sunrise'\n",
        "operator/d.py": "WAITING = 'vllm:num_requests_waiting'\nSAMPLE = 'daybreak_store_hits_total'\n"
                         "OTHER = 'daybreak_store_hits_by_tier'\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = respelled(tmp_path, labels.VOCABULARY | metrics.SHARED)
    assert sorted(f.split(" spells ")[0].split(": ")[0] + " " + f.split(" spells ")[1] for f in found) == sorted([
        "operator/a.py:1 'daybreak.dev/pool'",
        "operator/b.py:2 'daybreak.dev/v1alpha1'",
        "operator/b.py:2 'kvpools'",
        "operator/c.py:1 'app.kubernetes.io/name'",
        "operator/c.py:3 'daybreak.dev'",
        "operator/d.py:1 'vllm:num_requests_waiting'",
        "operator/d.py:2 'daybreak_store_hits'",
    ]), found
