#!/usr/bin/env python3
"""Every file the project's prose cites exists.

Over the source tree (build folders and .git left out) it checks:
  - every relative link of every Markdown file, [text](path) or [text](path#anchor), resolved
    against the Markdown file's folder: the file or folder must exist;
  - every file path cited in a Markdown file, a comment (C++, Python, shell, CMake) or a Python
    docstring: a path whose first folder is one of this project's (src/..., docs/design.md,
    include/eplb/..., scripts/..., examples/..., tests/...), an include path
    (eplb/runtime/config.h, runtime/config.h, runtime/monitor.h) or a path relative to the
    citing file must name a file of the tree;
  - every bare file name with a C or C++ extension (rebalancer.h, trigger.cc) must be the name of
    some file of the tree, and a bare Markdown name (design.md) that of a file beside the citing
    one, in docs/ or at the root.
Paths of other projects (vLLM's vllm/distributed/eplb/..., a URL, a system header in angle
brackets, a glob like *_test.cc) are not citations of this tree and are left alone, as are the
few names of other projects that look like this tree's (FOREIGN below, each with its owner).
Code is not read: only comments, docstrings and Markdown, where a name is a claim to a reader.

    file_references_test.py [SOURCE_ROOT]      # default: the checkout this file lives in

Prints every dead citation as FILE:LINE: CITATION (what it was looked for as) and exits 1 when
there is one.
"""

import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Names of other projects' files that look like this tree's, cited for what they are.
FOREIGN = {
    "tests/distributed/test_eplb_algo.py": "vLLM's test of its EPLB policies",
    "tests/distributed/test_eplb_migration_scheduler.py": "vLLM's test of its migration scheduler",
    "redis_store.h": "gloo's Redis store header",
    "class.h": "pybind11's",
}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules"}
CPP = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh", ".h.in")
HASH_COMMENTED = (".sh", ".cmake", ".toml", ".yml", ".yaml", ".supp", ".cfg")
# The extensions a cited path may end with: what this tree holds.
FILE_EXT = r"(?:h|hpp|cc|cpp|c|cu|cuh|in|py|pyi|md|sh|txt|cmake|json|csv|toml|supp|yml|yaml|cfg)"
# A path (folders, then a file with one of those extensions) or a bare C, C++ or Markdown file
# name; not when glued to what makes it a pattern, a variable or part of another name.
PATH_RE = re.compile(r"(?<![\w./@~$<>{}*-])((?:\.\.?/)*(?:[A-Za-z0-9_.-]+/)+"
                     r"[A-Za-z0-9_.-]*[A-Za-z0-9_]\." + FILE_EXT + r")(?![\w/-])")
BARE_RE = re.compile(r"(?<![\w./@~$<>{}:*-])"
                     r"([A-Za-z0-9_][A-Za-z0-9_-]*\.(?:h|hpp|cc|cpp|cu|cuh|md))(?![\w/-]|\.\w)")
LINK_RE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
LINK_TARGET_RE = re.compile(r"\]\([^)\s]+(?:\s+\"[^\"]*\")?\)")
URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
ANGLE_RE = re.compile(r"<[A-Za-z0-9_./+-]+\.(?:h|hpp)>")


def tree_files():
    for folder, dirs, files in os.walk(ROOT):
        # build*: build folders inside the checkout (build, build-address-undefined, ...).
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")
                         and not d.startswith("."))
        for name in sorted(files):
            yield os.path.relpath(os.path.join(folder, name), ROOT)


def cpp_comments(text):
    """(line, text) of every // and /* */ comment, string and character literals skipped."""
    out, i, line, n = [], 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i + 2:end]))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end
            for k, piece in enumerate(text[i + 2:end].split("\n")):
                out.append((line + k, piece))
            line += text.count("\n", i, end)
            i = end + 2
            continue
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum()
                                                          or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                end = n if end < 0 else end
                line += text.count("\n", i, end)
                i = end + len(m.group(1)) + 2
                continue
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 30'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        i += 1
    return out


def hash_comments(text):
    """(line, text) of every # comment: a # at the start of a line or after a space."""
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        quote = None
        for k, c in enumerate(line):
            if quote:
                if c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "#" and (k == 0 or line[k - 1] in " \t"):
                out.append((number, line[k + 1:]))
                break
    return out


def python_prose(text):
    """(line, text) of every comment and docstring of a Python file."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string[1:]))
        tree = ast.parse(text)
    except (SyntaxError, tokenize.TokenError):
        return hash_comments(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                first = body[0].lineno
                for k, piece in enumerate(body[0].value.value.split("\n")):
                    out.append((first + k, piece))
    return out


def prose(path, text):
    name = os.path.basename(path)
    if path.endswith(".md"):
        return list(enumerate(text.split("\n"), 1))
    if path.endswith(CPP):
        return cpp_comments(text)
    if path.endswith(".py"):
        return python_prose(text)
    if name == "CMakeLists.txt" or path.endswith(HASH_COMMENTED):
        return hash_comments(text)
    return []


def main():
    files = list(tree_files())
    present = set(files)
    folders = {os.path.dirname(f) for f in files}
    folders |= {os.path.dirname(d) for d in list(folders)}
    basenames = {os.path.basename(f) for f in files}
    top = {f.split("/")[0] for f in files if "/" in f}
    # First folders of include paths: eplb/... (include/), the layers of src/ and tests/, and
    # eplb/ of python/.
    include_roots = ["include", os.path.join("include", "eplb"), "src", "tests", "python",
                     os.path.join("python", "src")]
    rooted = set(top)
    for base in include_roots:
        if os.path.isdir(os.path.join(ROOT, base)):
            rooted |= {d for d in os.listdir(os.path.join(ROOT, base))
                       if os.path.isdir(os.path.join(ROOT, base, d))}

    def exists(rel):
        rel = os.path.normpath(rel)
        return rel in present or rel in folders or os.path.exists(os.path.join(ROOT, rel))

    dead = []
    checked = 0
    for path in files:
        if not path.endswith((".md",) + CPP + HASH_COMMENTED + (".py",)) and \
                os.path.basename(path) != "CMakeLists.txt":
            continue
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        here = os.path.dirname(path)
        for number, line in prose(path, text):
            if path.endswith(".md"):
                for target in LINK_RE.findall(line):
                    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
                        continue
                    checked += 1
                    target = target.split("#")[0]
                    if not exists(os.path.join(here, target)):
                        dead.append(f"{path}:{number}: link ({target}) names no file or folder")
                line = LINK_TARGET_RE.sub("]", line)  # checked above, as links
            line = ANGLE_RE.sub(" ", URL_RE.sub(" ", line))
            for cited in PATH_RE.findall(line):
                parts = [p for p in cited.split("/") if p not in (".", "..")]
                if (not cited.startswith(".") and parts[0] not in rooted) or cited in FOREIGN:
                    continue  # another project's path
                checked += 1
                tries = [os.path.join(here, cited)] + [os.path.join(base, cited)
                                                       for base in [""] + include_roots]
                if not any(exists(t) for t in tries):
                    dead.append(f"{path}:{number}: {cited} (no such file)")
            for cited in BARE_RE.findall(PATH_RE.sub(" ", line)):
                if cited in FOREIGN:
                    continue
                checked += 1
                if cited.endswith(".md"):
                    ok = any(exists(os.path.join(d, cited)) for d in (here, "", "docs"))
                else:
                    ok = cited in basenames
                if not ok:
                    dead.append(f"{path}:{number}: {cited} (no file of that name)")
    for d in dead:
        print(d)
    if dead:
        print("Fix the citation (the file moved or was renamed?); a name of another project's "
              "file that looks like this tree's goes in FOREIGN, in "
              "tests/docs/file_references_test.py")
    print(f"file references: {checked} checked, {len(dead)} dead")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
