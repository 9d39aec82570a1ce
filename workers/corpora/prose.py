"""Prose domain: the language reference topics that ``pydoc`` ships and the stdlib's docstrings.

Docstrings are read with :mod:`ast`, never by importing modules (importing ``antigravity`` opens a
browser; ``tkinter`` needs a display). A module's docstrings form one document and take the split of
that module's file, so a held-out prose document never sits inside a training code file.
"""

from __future__ import annotations

import ast
import inspect

from workers.corpora._common import Document, split_of, stdlib_modules

DOMAIN = "prose"
# Docstrings shorter than this are mostly one-liners ("Return self.") that say little as prose.
_MIN_DOCSTRING_CHARS = 60


def _topic_documents() -> list[Document]:
    from pydoc_data import topics  # the text `help("lambda")` shows; ships with every CPython

    docs = []
    for name in sorted(topics.topics):
        text = topics.topics[name].strip() + "\n"
        docs.append(Document(DOMAIN, f"topic:{name}", "reference", text, split_of(f"topic:{name}")))
    return docs


def _docstrings(tree: ast.Module) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) in source order, for the module, classes and functions."""
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                    out.append((name, doc))
                if isinstance(child, ast.ClassDef):
                    visit(child, name + ".")

    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc and len(module_doc) >= _MIN_DOCSTRING_CHARS:
        out.append(("", module_doc))
    visit(tree, "")
    return out


def _docstring_documents() -> list[Document]:
    docs = []
    for rel, source in stdlib_modules():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        parts = []
        for name, doc in _docstrings(tree):
            title = module if not name else f"{module}.{name}"
            parts.append(f"{title}\n\n{inspect.cleandoc(doc)}\n")
        if parts:
            # The split key is the file path, shared with the code domain (see module docstring).
            docs.append(Document(DOMAIN, f"docstrings:{rel}", "docstring", "\n".join(parts), split_of(rel)))
    return docs


def build() -> list[Document]:
    """All prose documents, topics first, then docstrings by module path."""
    return _topic_documents() + _docstring_documents()
