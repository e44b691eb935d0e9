"""A lesson file side by side: each docstring and comment beside the lines it explains.

    minddp site build          # every lesson page of the site is made here, from its file

The file is cut into sections, as docco and pycco do: a section opens with a block of
whole-line comments, or with a `def`/`class` that has a docstring (the comments right above
it and its decorators come along), and runs to the next one. A section's prose is its
comments and docstring; its code is every other line, with the file's own line numbers.
A comment at the end of a code line stays in the code: it belongs to that line. The prose
is read as Markdown; the code is highlighted by Pygments, the whole file at once, so a
string or bracket that spans a section's edge is coloured as Python reads it.
"""

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field


@dataclass
class Section:
    prose: list = field(default_factory=list)  # Markdown lines; "" between paragraphs
    code: list = field(default_factory=list)  # (line number, highlighted html) pairs


def _docstrings(tree):
    """{first line of the docstring: (last line, the owner's first line, its text)}."""
    found = {}
    owners = [tree] + [n for n in ast.walk(tree)
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in owners:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str) \
                and (node is tree or body[0].lineno > node.lineno):  # `def f(): """x"""`: code
            first = min([node.lineno] + [d.lineno for d in node.decorator_list]) \
                if node is not tree else 1
            found[body[0].lineno] = (body[0].end_lineno, first,
                                     _dedent(body[0].value.value, body[0].col_offset))
    return found


def _dedent(text, indent):
    """A docstring's lines less the indent of the code around it, and no more: a block
    indented further stays indented (Markdown's code), which inspect.cleandoc would undo
    where every line after the first is such a block."""
    lines = text.expandtabs().splitlines()
    lines = [lines[0].strip()] + [line[min(indent, len(line) - len(line.lstrip())):].rstrip()
                                  for line in lines[1:]]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(lines)


def _comment_lines(source):
    """{line number: the comment's text} for every line that is a comment and nothing else."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and not token.line[:token.start[1]].strip():
            text = token.string[1:]
            found[token.start[0]] = text[1:] if text.startswith(" ") else text
    return found


def sections(source, highlighted, module_docstring=True):
    """The file's sections, in order. `highlighted`: the file's lines as html, one a line.
    Without module_docstring, the file's own docstring is left out (a chapter's first page
    shows it as the page itself)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    comments = _comment_lines(source)
    opens = {first: doc for doc, (_, first, _) in docstrings.items()}  # a def with a docstring
    found = [Section()]
    skip_to = 0
    for number, line in enumerate(lines, 1):
        if number <= skip_to:
            continue
        current = found[-1]
        if number in comments:
            if current.code:
                current = Section()
                found.append(current)
            current.prose.append(comments[number])
        elif number in opens and number != 1 and current.code:  # a def and its docstring
            found.append(Section(code=[(number, highlighted[number - 1])]))
        elif number in docstrings:
            last, _, text = docstrings[number]
            skip_to = last
            if number == tree.body[0].lineno and not module_docstring:
                continue
            if current.prose:
                current.prose.append("")
            current.prose.extend(text.splitlines())
        elif not line.strip():
            if current.code:
                current.code.append((number, ""))
            elif current.prose and current.prose[-1]:
                current.prose.append("")  # a blank line between two comment blocks
        else:
            current.code.append((number, highlighted[number - 1]))
    for section in found:
        while section.code and not section.code[-1][1]:
            section.code.pop()  # the blank lines before the next section
        while section.prose and not section.prose[-1]:
            section.prose.pop()
    return [s for s in found if s.prose or s.code]


def highlight(source):
    """The file's lines as html with Pygments' classes (Material's colours), one a line."""
    from pygments import highlight as pygmentize
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer
    text = pygmentize(source, PythonLexer(stripnl=False, ensurenl=True),
                      HtmlFormatter(nowrap=True))
    lines = text.split("\n")
    return lines[:len(source.splitlines())]


def code_html(code):
    """A section's code: each line its real number (an anchor, #L12) and its text. One
    inner div only: Material's search ends a data-search-exclude at the first </div>
    inside it (its parser tells elements apart by tag), so a second one would leak."""
    rows = [f'<span class="sbs-line" id="L{n}"><a class="sbs-n" href="#L{n}">{n}</a>'
            f'{text}</span>' for n, text in code]
    return ('<div class="highlight"><pre><code>' + "\n".join(rows) + "</code></pre></div>")


_SPECIAL = re.compile(r"([\\_*>\[\]])")
_EMPHASIS = re.compile(r"(?<![\w*])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![\w*])")  # *average*
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_PATH = re.compile(r"(?<![\w/.-])((?:minddp|examples|docs)/[\w/.-]*\w\.(?:py|md))(?![\w/])")


def prose_markdown(lines, link):
    """Docstring and comment text as Markdown: plain text stays plain (an `__init__` or a
    `*args` is no emphasis), a path to a page of the site becomes a link to it (`link(path)`:
    its url, or None), an indented block is code, a list may follow a line at once."""
    out = []
    for number, line in enumerate(lines):
        before = out[-1] if out else ""
        indented = line.startswith("    ") or line.startswith("\t")
        if indented and before.strip() and not before.startswith(("    ", "\t")) \
                and not _is_item(before):
            out.append("")  # Markdown wants a blank line before an indented code block
        elif _is_item(line) and before.strip() and not _in_item(out):
            out.append("")  # and before a list
        elif line.strip() and not line.startswith((" ", "\t")) and not _is_item(line) \
                and before.strip() and (before.startswith(("    ", "\t")) or _in_item(out)):
            out.append("")  # after a code block or a list, a paragraph
        if indented and not _in_item(out):
            out.append(line)
        else:
            marker = re.match(r"\s*(?:(?:[-*+]|\d+[.)])\s+)?", line).group(0)
            out.append(marker + _inline(line[len(marker):], link))
    return "\n".join(out)


def _is_item(line):
    return bool(re.match(r"\s{0,3}(?:[-*+]|\d+[.)])\s", line))


def _in_item(out):
    """Is the last paragraph written a list item (an indented line continues it)?"""
    for line in reversed(out):
        if not line.strip():
            return False
        if _is_item(line):
            return True
        if not line.startswith(" "):
            return False
    return False


def _inline(line, link):
    """One line of prose: code spans kept, paths linked, Markdown's marks escaped."""
    parts, end = [], 0
    for match in _CODE_SPAN.finditer(line):
        parts.append(_plain(line[end:match.start()], link))
        url = link(match.group(2))
        parts.append(f"[{match.group(0)}]({url})" if url else match.group(0))
        end = match.end()
    parts.append(_plain(line[end:], link))
    return "".join(parts)


def _plain(text, link):
    parts, end = [], 0
    for match in _PATH.finditer(text):
        url = link(match.group(1))
        if url:
            parts.append(_escape(text[end:match.start()]))
            parts.append(f"[`{match.group(1)}`]({url})")
            end = match.end()
    parts.append(_escape(text[end:]))
    return "".join(parts)


def _escape(text):
    """Markdown's marks as plain characters; `<` as an entity (Markdown has no escape for it)."""
    parts, end = [], 0
    for match in _EMPHASIS.finditer(text):
        parts.append(_SPECIAL.sub(r"\\\1", text[end:match.start()]))
        parts.append("*" + _SPECIAL.sub(r"\\\1", match.group(1)) + "*")
        end = match.end()
    parts.append(_SPECIAL.sub(r"\\\1", text[end:]))
    return "".join(parts).replace("<", "&lt;")


def page(source, link, skip_module_docstring=False):
    """The Markdown of a lesson's side-by-side part: one row per section, prose left (as
    Markdown, so that the site checks its links), code right (html, kept out of the search
    index: the prose is what a search should find)."""
    found = sections(source, highlight(source), not skip_module_docstring)
    if not found:
        return ""
    rows = ['<div class="sbs" markdown>']
    for section in found:
        rows += ['<div class="sbs-row" markdown>', '<div class="sbs-prose" markdown>', "",
                 prose_markdown(section.prose, link), "", "</div>",
                 '<div class="sbs-code" data-search-exclude>',
                 code_html(section.code) if section.code else "", "</div>", "</div>"]
    rows.append("</div>")
    return "\n".join(rows) + "\n"

