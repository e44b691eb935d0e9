"""The site's pages, written from the repository as it is now: nothing in them is copied by hand.

    minddp site build          # writes these pages into a folder, then MkDocs builds them

The chapters and their files come from the reading order (`minddp lessons`,
tools/course.py), so a chapter added there is a section here. Each chapter's first page is
its __init__.py's docstring; each file of it gets a side-by-side page (side_by_side.py) and
a plain copy to open whole. A docs page goes to the first chapter whose docstring names it,
the others under "More"; the exercises come from the grader's table (EXERCISES), each with
its TODOs, its starting file and what docs/grade.md shows the grader saying.
"""

import ast
import pathlib
import posixpath
import re
import shutil
from dataclasses import dataclass, field

from ..grader.exercises import EXERCISES
from ..grader.writer import starting_file
from ..tools.course import chapters
from . import side_by_side

ROOT = pathlib.Path(__file__).resolve().parents[2]
PICTURES = (".png", ".svg", ".jpg")


@dataclass
class Part:
    """A section of the site: a chapter (a folder of minddp/) or a heading of examples."""
    title: str  # in the navigation: "minddp/ddp/", or the heading's words before a colon
    heading: str  # the reading order's heading
    folder: str = None  # "minddp/ddp" for a chapter
    files: list = field(default_factory=list)  # repository paths, in the reading order
    docs: list = field(default_factory=list)  # the docs pages its first page names
    exercises: list = field(default_factory=list)  # the exercises made from its lessons


def parts(root=ROOT):
    """The course's parts in the reading order, each with its files, docs and exercises."""
    found, named = [], set()
    for heading, paths in chapters(root):
        match = re.fullmatch(r"`(minddp/\w+)/`", heading)
        if not match:
            found.append(Part(re.split(r"[:,]", heading)[0], heading, files=list(paths)))
            continue
        folder = match.group(1)
        extra = sorted(p.relative_to(root).as_posix() for p in (root / folder).glob("*.py")
                       if p.relative_to(root).as_posix() not in paths)
        part = Part(f"{folder}/", heading, folder, list(paths) + extra)
        doc = first_docstring(root / folder / "__init__.py")
        for name in re.findall(r"docs/([\w.-]+\.md)", doc):
            if name not in named:
                named.add(name)
                part.docs.append(name)
        found.append(part)
    by_folder = {part.folder: part for part in found if part.folder}
    for name, exercise in EXERCISES.items():
        folder = "minddp/" + exercise.path.rsplit("/", 1)[0]
        if folder in by_folder:
            by_folder[folder].exercises.append(name)
    return found


def first_docstring(path):
    """A file's own docstring, its indented blocks kept indented (side_by_side._dedent)."""
    tree = ast.parse(pathlib.Path(path).read_text())
    if ast.get_docstring(tree) is None:
        return ""
    return side_by_side._dedent(tree.body[0].value.value, 0)


def page_of(path):
    """The site's page (a path in the generated folder) for a file of the repository."""
    if path.endswith("/__init__.py"):
        return path[:-len("__init__.py")] + "index.md"
    if path.endswith(".py"):
        return path[:-3] + ".md"
    return path


def source_of(path):
    """The plain copy of a file, to open it whole: text/plain on any web server."""
    return f"source/{path}.txt"


def relative(target, page):
    return posixpath.relpath(target, posixpath.dirname(page) or ".")


class Writer:
    """Writes every page into `out` (a folder MkDocs reads); `nav` is the navigation."""

    def __init__(self, out, root=ROOT):
        self.out, self.root = pathlib.Path(out), pathlib.Path(root)
        self.parts = parts(self.root)
        self.pages = {}  # repository path -> site page, for the links between them
        for part in self.parts:
            for path in part.files:
                self.pages[path] = page_of(path)
        for doc in sorted((self.root / "docs").glob("*.md")):
            self.pages[f"docs/{doc.name}"] = f"docs/{doc.name}"

    def write(self, page, text):
        target = self.out / page
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def linker(self, page, always_docs=False):
        """A function: a repository path -> its url relative to `page`, or None. With
        always_docs, a docs/X.md is linked even if missing, so that the build fails."""
        def link(path):
            if path in self.pages or (always_docs and path.startswith("docs/")):
                return relative(self.pages.get(path, path), page)
            return None
        return link

    def all(self):
        """Every page, the pictures and the copies; returns the navigation."""
        home = [{"Home": "index.md"}]
        self.home()
        sections = [self.part(part) for part in self.parts]
        exercises = self.exercises()
        placed = {f"docs/{d}" for part in self.parts for d in part.docs} | {"docs/grade.md"}
        self.readme()
        more = [{"README.md": "readme.md"}] + [{f"docs/{d.name}": f"docs/{d.name}"}
                                for d in sorted((self.root / "docs").glob("*.md"))
                                if f"docs/{d.name}" not in placed]
        for doc in sorted((self.root / "docs").glob("*.md")):
            self.docs_page(doc)
        for picture in sorted((self.root / "docs").iterdir()):
            if picture.suffix in PICTURES:
                (self.out / "docs").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(picture, self.out / "docs" / picture.name)
        return home + sections + [{"Exercises": exercises}, {"More": more}]

    def home(self):
        """What minddp is and its two set-up steps (the README's words), the chapters."""
        readme = (self.root / "README.md").read_text()
        intro = readme.split("\n## ", 1)[0]
        setup = re.search(r"\n## Set up\n(.*?)(?=\n## )", readme, re.S).group(1)
        rows = ["| part | what it teaches | files |", "| --- | --- | --- |"]
        for part in self.parts:
            first = self.pages[part.files[0]]
            if part.folder:
                idea = first_docstring(self.root / part.files[0]).splitlines()[0]
            else:
                idea = part.heading
            idea = side_by_side.prose_markdown([idea], self.linker("index.md"))
            rows.append(f"| [{part.title}]({first}) | {idea} | {len(part.files)} |")
        text = (f"{self.autolink(intro, 'index.md')}\n\n## Set up\n{setup}\n"
                "## The course, in the reading order\n\n"
                "Each part opens with its first page; each file is shown side by side, its "
                "docstring and comments beside the lines they explain. The exercises: "
                f"[docs/grade.md](docs/grade.md).\n\n" + "\n".join(rows) + "\n")
        self.write("index.md", text)

    def readme(self):
        text = (self.root / "README.md").read_text()
        self.write("readme.md", self.autolink(text, "readme.md"))

    def part(self, part):
        """A chapter's pages: its first page, a page per file, its docs, its exercises."""
        entries = []
        for number, path in enumerate(part.files, 1):
            page = self.pages[path]
            if path.endswith("/__init__.py"):
                self.chapter_page(part, path)
                entries.append(page)
            else:
                self.lesson_page(part, path, number)
                entries.append({path.rsplit("/", 1)[1]: page})
        entries += [{f"docs/{name}": f"docs/{name}"} for name in part.docs]
        return {part.title: entries}

    def copy(self, path):
        target = source_of(path)
        self.write(target, (self.root / path).read_text())
        return target

    def chapter_page(self, part, path):
        page = self.pages[path]
        text = (self.root / path).read_text()
        doc = first_docstring(self.root / path).splitlines()
        link = self.linker(page, always_docs=True)
        rows = ["| # | file | lines | idea |", "| --- | --- | --- | --- |"]
        for number, file in enumerate(part.files, 1):
            if file != path:
                idea = side_by_side.prose_markdown(
                    first_docstring(self.root / file).splitlines()[:1], lambda p: None)
                lines = len((self.root / file).read_text().splitlines())
                target = relative(self.pages[file], page)
                rows.append(f"| {number} | [`{file}`]({target}) | {lines} | {idea} |")
        out = [f"# {side_by_side.prose_markdown(doc[:1], link)}", "",
               f"The chapter `{part.folder}/`, its first page: the docstring of "
               f"[`{path}`]({relative(self.copy(path), page)}).", "",
               side_by_side.prose_markdown(doc[1:], link), "",
               "## Read in this order", "", *rows, ""]
        if part.docs:
            out += ["## Its docs pages", ""] + [
                f"- [docs/{name}]({relative('docs/' + name, page)})" for name in part.docs]
            out.append("")
        if part.exercises:
            out += ["## Its exercises", ""] + [
                f"- [{name}]({relative(f'exercises/{name}.md', page)}): "
                f"{', '.join(f'`{q}`' for q in EXERCISES[name].todo)}"
                for name in part.exercises]
            out.append("")
        code = side_by_side.page(text, link, skip_module_docstring=True)
        if code:
            out += [f"## `{path.rsplit('/', 1)[1]}` itself", "", code]
        self.write(page, "\n".join(out) + "\n")

    def lesson_page(self, part, path, number):
        page = self.pages[path]
        text = (self.root / path).read_text()
        link = self.linker(page, always_docs=True)
        facts = [f"[the file]({relative(self.copy(path), page)}), {len(text.splitlines())}"
                 f" lines", f"file {number} of {len(part.files)} in {part.title}"]
        for exercise in part.exercises:
            if f"minddp/{EXERCISES[exercise].path}" == path:
                facts.append(f"exercise: [{exercise}]"
                             f"({relative(f'exercises/{exercise}.md', page)})")
        out = ["---", "hide: [toc]", "---", "", f"# `{path}`", "", " · ".join(facts), "",
               side_by_side.page(text, link)]
        self.write(page, "\n".join(out))

    def exercises(self):
        """A page per exercise: the lesson, what to write, the starting file, the grader."""
        grade = (self.root / "docs" / "grade.md").read_text()
        entries = [{"docs/grade.md": "docs/grade.md"}]
        for name, exercise in EXERCISES.items():
            page = f"exercises/{name}.md"
            lesson = f"minddp/{exercise.path}"
            ranks = ", ".join(map(str, exercise.ranks))
            out = [f"# Exercise `{name}`", "",
                   f"Write again what [`{lesson}`]({relative(self.pages[lesson], page)})"
                   f" does, graded against {exercise.against}, at {ranks} ranks by default"
                   f" (any of {', '.join(map(str, exercise.allowed))}).", "",
                   "```bash", f"minddp exercise {name} exercises/   # writes exercises/{name}.py",
                   f"minddp grade exercises/{name}.py", "```", "", "## What to write", ""]
            out += [f"- `{q}`: {side_by_side.prose_markdown([what], lambda p: None)}."
                    for q, what in exercise.todo.items()]
            row = _table_row(grade, name)
            if row:
                out += ["", "## What the grader checks", "", row.get("graded against", ""),
                        "", "(from [docs/grade.md](../docs/grade.md))"]
            said = re.search(rf"\n### {re.escape(name)}: (.*?)\n(.*?)(?=\n#+ )", grade, re.S)
            if said:
                out += ["", f"## What the grader says to a mistake: {said.group(1)}",
                        said.group(2)]
            out += ["", "## The starting file", "",
                    f"What `minddp exercise {name}` writes, made from the lesson now:", "",
                    self.listing(starting_file(name)), ""]
            self.write(page, "\n".join(out))
            entries.append({f"exercise: {name}": page})
        return entries

    @staticmethod
    def listing(text):
        """A whole file as one box of numbered code, kept out of the search (a search for
        its words should find the lesson's own page)."""
        lines = side_by_side.highlight(text)
        return ('<div class="sbs-code" data-search-exclude>\n'
                + side_by_side.code_html(list(enumerate(lines, 1))) + "\n</div>")

    def docs_page(self, doc):
        page = f"docs/{doc.name}"
        self.write(page, self.autolink(doc.read_text(), page))

    def autolink(self, text, page):
        """A Markdown page with every `path` of a page of the site linked to it (outside code
        blocks, headings and links), and a blank line before a list that follows a line (as
        GitHub reads it; Python-Markdown would run it into the paragraph)."""
        link = self.linker(page)
        out, fenced = [], False
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and not line.startswith("#"):
                line = re.sub(r"(?<!\[)`([\w/.-]+)`(?!\])", lambda m: (
                    f"[`{m.group(1)}`]({link(m.group(1))})" if link(m.group(1))
                    else m.group(0)), line)
                before = out[-1] if out else ""
                if side_by_side._is_item(line) and before.strip() \
                        and not side_by_side._is_item(before) and not before.startswith(" ") \
                        and not before.startswith("|"):
                    out.append("")
            out.append(line)
        return "\n".join(out) + "\n"


def _table_row(text, name):
    """docs/grade.md's table row of an exercise: {column: cell}."""
    header = None
    for line in text.splitlines():
        if line.startswith("| exercise |"):
            header = [c.strip() for c in line.strip("|").split("|")]
        elif header and line.startswith(f"| `{name}` |"):
            return dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
    return None
