"""A real text corpus for `laneserve demo`, built from text that ships with every Python install.

Documents to summarize are the docstrings of standard-library modules, classes and functions
(whitespace normalised, cut at a paragraph boundary to at most `max_doc_chars`); sentences to
translate are prose sentences taken from those docstrings (8-30 words, no code). The result is
deterministic for a given Python version: modules are read in a fixed order and sentences are
taken round-robin across modules so the set is varied.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

# Standard-library modules read in this order (those missing from a build are skipped).
MODULES = (
    "json", "csv", "argparse", "collections", "itertools", "functools", "pathlib", "os",
    "re", "datetime", "logging", "subprocess", "threading", "asyncio", "heapq", "bisect",
    "random", "statistics", "string", "textwrap", "shutil", "tempfile", "glob", "fnmatch",
    "hashlib", "base64", "zipfile", "tarfile", "gzip", "sqlite3", "urllib.parse",
    "http.client", "email.message", "xml.etree.ElementTree", "unittest", "doctest", "pdb",
    "timeit", "pprint", "copy", "enum", "dataclasses", "typing", "contextlib", "abc",
    "operator", "decimal", "fractions", "math", "uuid", "socket", "selectors", "queue",
    "sched", "calendar", "difflib", "inspect", "ast", "tokenize", "dis", "codecs", "io",
    "struct", "weakref", "traceback", "warnings", "configparser", "shelve", "pickle",
    "secrets", "hmac", "ipaddress", "mimetypes", "html.parser", "colorsys", "graphlib",
    "zoneinfo", "smtplib", "ftplib", "imaplib", "poplib", "mailbox", "plistlib", "netrc",
    "getopt", "optparse", "cmd", "shlex", "trace", "tracemalloc", "filecmp", "fileinput",
)  # fmt: skip
MIN_DOC_CHARS = 300
DOCS_PER_MODULE = 2  # the module's docstring first, then its longest class/function docstring
MIN_WORDS, MAX_WORDS = 8, 30
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Characters that mark code, markup or cross-references rather than prose.
_CODE_CHARS = re.compile(r"[_=(){}\[\]<>`*#|\\@$%^~:;/\"]|\.\.\.|>>>|\bsee\b|\bSee\b")


@dataclass(frozen=True, slots=True)
class Corpus:
    """Texts with stable ids: `documents` to summarize, `sentences` to translate."""

    documents: list[tuple[str, str]]  # (id, text)
    sentences: list[tuple[str, str]]


def _clean(text: str) -> str:
    """Collapse whitespace and drop reST markup (:mod:`json` -> json, ``obj`` -> obj)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = text.replace("``", "").replace("`", "")
    return re.sub(r"\s+", " ", text).strip()


def _paragraphs(doc: str) -> list[str]:
    return [_clean(p) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc)) if p.strip()]


def _cut(paragraphs: list[str], max_chars: int) -> str:
    """Whole paragraphs up to max_chars (the first one cut at a sentence if it alone is longer)."""
    out: list[str] = []
    size = 0
    for para in paragraphs:
        if size + len(para) > max_chars:
            if not out:
                sentences = _SENTENCE_END.split(para)
                for s in sentences:
                    if size + len(s) > max_chars:
                        break
                    out.append(s)
                    size += len(s) + 1
            break
        out.append(para)
        size += len(para) + 1
    return " ".join(out)


def _docstrings(module_name: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) for the module and its public classes and functions."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # not built on this Python (e.g. no _sqlite3): skip it
        return []
    out = []
    if module.__doc__:
        out.append((module_name, module.__doc__))
    for name in sorted(getattr(module, "__all__", None) or dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = inspect.getdoc(obj)
        if doc:
            out.append((f"{module_name}.{name}", doc))
    return out


def _is_prose(sentence: str) -> bool:
    words = sentence.split()
    return (
        MIN_WORDS <= len(words) <= MAX_WORDS
        and sentence[0].isupper()
        and sentence.endswith(".")
        and not _CODE_CHARS.search(sentence)
        and sum(w.isalpha() for w in words) >= 0.8 * len(words)
    )


def build_corpus(
    n_documents: int, n_sentences: int, max_doc_chars: int = 800, strict: bool = True
) -> Corpus:
    """The first `n_documents` documents and `n_sentences` sentences (see the module docstring);
    with `strict=False`, as many as there are when fewer.

    Raises:
        ValueError: (strict) the standard library of this Python does not give that many (more
            than a hundred documents and a few hundred sentences on CPython 3.11).
    """
    if n_documents < 0 or n_sentences < 0 or max_doc_chars < MIN_DOC_CHARS:
        raise ValueError("counts must be >= 0 and max_doc_chars >= MIN_DOC_CHARS")
    documents: list[tuple[str, str]] = []
    per_module: list[list[str]] = []
    seen: set[str] = set()
    for module_name in MODULES:
        sentences: list[str] = []
        candidates = []
        for qualname, doc in _docstrings(module_name):
            paragraphs = _paragraphs(doc)
            text = _cut(paragraphs, max_doc_chars)
            if len(text) >= MIN_DOC_CHARS:
                candidates.append((qualname, text))
            for para in paragraphs:
                for s in _SENTENCE_END.split(para):
                    if _is_prose(s) and s not in seen:
                        seen.add(s)
                        sentences.append(s)
        per_module.append(sentences)
        if candidates and candidates[0][0] == module_name:  # module docstring, longest other
            chosen = candidates[:1] + sorted(candidates[1:], key=lambda c: -len(c[1]))
        else:
            chosen = sorted(candidates, key=lambda c: -len(c[1]))
        documents.extend(chosen[: min(DOCS_PER_MODULE, n_documents - len(documents))])
        if len(documents) >= n_documents and len(seen) >= 3 * n_sentences:
            break
    picked: list[tuple[str, str]] = []
    for rank in range(max((len(s) for s in per_module), default=0)):
        for sentences in per_module:
            if rank < len(sentences) and len(picked) < n_sentences:
                picked.append((f"s{len(picked) + 1:04d}", sentences[rank]))
    if strict and (len(documents) < n_documents or len(picked) < n_sentences):
        raise ValueError(
            f"the standard library gave {len(documents)} documents and {len(picked)} sentences; "
            f"asked for {n_documents} and {n_sentences}"
        )
    return Corpus(documents=documents, sentences=picked)


def write_jsonl(path: Path, items: list[tuple[str, str]]) -> Path:
    """Write `{"id": ..., "text": ...}` lines (the task shorthand of `laneserve submit`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item_id, text in items:
            f.write(json.dumps({"id": item_id, "text": text}) + "\n")
    return path
