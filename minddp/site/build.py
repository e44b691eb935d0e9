"""`minddp site`: the course as a web site, built from the repository, served, photographed.

    minddp site build                  # into build/site/ (git ignores it); strict
    minddp site serve --port 8000      # build, then serve it at http://127.0.0.1:8000/
    minddp site shots docs/            # build, open it in headless Chromium: 3 screenshots

The pages are written into a fresh folder (pages.py) and MkDocs with the Material theme
builds them, strictly: a link to a page or picture that is not there, a file of the
reading order that is missing, or a page outside the navigation stops the build with the
reason and exit 1. Needs the site extra: pip install -e ".[site]" (docs/site.md).
"""

import json
import logging
import pathlib
import sys
import tempfile
import time

from ..run.cli import ArgumentParser

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "site"
HINT = 'pip install -e ".[site]"'

CSS = """
/* The side-by-side lesson: a row per section, prose left, code right, of one height. */
.md-grid { max-width: 96rem; }
.sbs-row { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1.75fr);
           border-top: 1px solid var(--md-default-fg-color--lightest); }
.sbs-prose { padding: 0 0.9rem 0 0; font-size: 0.7rem; min-width: 0; }
.sbs-prose > :first-child { margin-top: 0.5rem; }
.sbs-code { background: var(--md-code-bg-color); min-width: 0; }
.md-typeset .sbs-code .highlight, .md-typeset .sbs-code pre { margin: 0; }
.md-typeset .sbs-code pre > code { padding: 0.5rem 0.5rem; font-size: 0.62rem;
                                   line-height: 1.5; background: transparent; }
.sbs-line { display: block; }
.md-typeset .sbs-n { display: inline-block; width: 2.4em; margin-right: 1em; text-align: right;
                     color: var(--md-default-fg-color--light); user-select: none; }
.sbs-line:target { background: var(--md-code-hl-color); }
"""


def config(docs, out, nav):
    """MkDocs' configuration, written beside the generated pages."""
    return {
        "site_name": "minddp: the course",
        "site_description": "Distributed training built by hand, read side by side",
        "docs_dir": str(docs), "site_dir": str(out), "strict": True,
        "use_directory_urls": True, "nav": nav,
        "theme": {"name": "material", "font": False,  # no fonts from the network
                  "features": ["navigation.indexes", "navigation.footer"],
                  "palette": {"primary": "indigo"}},
        "extra_css": ["assets/minddp.css"],
        "plugins": ["search"],
        "markdown_extensions": [
            "tables", "attr_list", "md_in_html", "admonition",
            {"toc": {"permalink": True}},
            {"pymdownx.highlight": {"anchor_linenums": True}}, "pymdownx.superfences"],
        "validation": {"nav": {"omitted_files": "warn", "not_found": "warn"},
                       "links": {"not_found": "warn", "anchors": "warn",
                                 "absolute_links": "warn", "unrecognized_links": "warn"}},
    }


class BuildFailed(Exception):
    """The site has problems (each a line of MkDocs' warnings, or a missing file)."""


def build(out=OUT, root=ROOT):
    """Write the pages and build the site into `out`, strictly: (pages, seconds). Raises
    BuildFailed, or ImportError without the site extra."""
    import mkdocs  # noqa: F401  (before any page is written: the extra's absence, at once)
    from . import pages
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minddp-site-") as work:
        docs = pathlib.Path(work) / "pages"
        try:
            nav = pages.Writer(docs, root).all()
        except (OSError, AttributeError, SyntaxError) as err:  # a file of the order is gone
            raise BuildFailed([f"a page could not be written: {err}"]) from err
        (docs / "assets").mkdir(parents=True, exist_ok=True)
        (docs / "assets" / "minddp.css").write_text(CSS)
        run_mkdocs(docs, out, nav)
    count = sum(1 for _ in pathlib.Path(out).rglob("index.html"))
    return count, time.perf_counter() - start


def run_mkdocs(docs, out, nav):
    """MkDocs on the folder of pages `docs`, into `out`, strict: each warning (a link to
    nothing, an anchor that is not there, a page outside `nav`) raises BuildFailed."""
    import mkdocs.commands.build
    import mkdocs.config
    import mkdocs.exceptions
    problems = []
    handler = _Collect(problems)
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        config_file = pathlib.Path(docs).parent / "mkdocs.yml"
        text = json.dumps(config(pathlib.Path(docs).resolve(), pathlib.Path(out).resolve(), nav))
        config_file.write_text(text)  # JSON is YAML
        try:
            mkdocs.commands.build.build(mkdocs.config.load_config(config_file=str(config_file)))
        except mkdocs.exceptions.MkDocsException as err:
            raise BuildFailed(problems or [str(err)]) from err
    finally:
        logger.removeHandler(handler)
    if problems:  # (strict mode raises on them; this is in case it ever does not)
        raise BuildFailed(problems)


def not_a_site(out):
    """A reason to refuse `out`: MkDocs empties its folder first, so it must be new, empty
    or a site built before."""
    out = pathlib.Path(out)
    if out.exists() and not out.is_dir():
        return f"{out} is a file"
    if out.is_dir() and any(out.iterdir()) and not (out / "search" / "search_index.json").exists():
        return f"{out} holds files that are not a built site, and the build would delete them"
    return None


class _Collect(logging.Handler):
    def __init__(self, problems):
        super().__init__(logging.WARNING)
        self.problems = problems

    def emit(self, record):
        self.problems.append(record.getMessage().replace("\n", " "))


def missing_extra(err):
    return (f"error: the site needs its extra ({err.name or err} is not installed)\n"
            f"---> HINT: {HINT}\n")


def main(argv=None):
    parser = ArgumentParser(prog="minddp site", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", metavar="build|serve|shots")
    make = commands.add_parser("build", help="build the site (strict)")
    make.add_argument("--out", default=str(OUT), help="where the site goes (build/site)")
    serve = commands.add_parser("serve", help="build, then serve it on this machine")
    serve.add_argument("--out", default=str(OUT), help="where the site goes (build/site)")
    serve.add_argument("--port", type=int, default=8000, help="the port (8000)")
    shots = commands.add_parser("shots", help="screenshots of three pages, for docs/site.md")
    shots.add_argument("directory", help="where the PNG files go")
    shots.add_argument("--chromium", default="/usr/bin/chromium", help="the browser")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("which: build, serve or shots?")
    if args.command != "shots" and not_a_site(args.out):
        print(f"error: --out {args.out}: {not_a_site(args.out)}\n---> HINT: a new or empty"
              " folder (the default: build/site)", file=sys.stderr)
        return 2
    server = None
    if args.command == "serve":  # the port first: a port in use costs no build
        from .browser import bind
        try:
            server = bind(args.out, args.port)
        except OSError as err:
            print(f"error: port {args.port}: {err.strerror}\n---> HINT: another port:"
                  f" minddp site serve --port {args.port + 1}", file=sys.stderr)
            return 2
    try:
        if args.command == "shots":
            return _shots(args)
        count, seconds = build(args.out)
    except ImportError as err:
        sys.stderr.write(missing_extra(err))
        return 1
    except BuildFailed as err:
        problems = err.args[0]
        print(f"error: the site did not build: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        print("---> HINT: mend each link or file named (the build is strict: docs/site.md)",
              file=sys.stderr)
        return 1
    print(f"built {count} pages into {args.out} in {seconds:.1f} s")
    if server is not None:
        from .browser import serve_forever
        serve_forever(server, args.out, args.port)
    return 0


def _shots(args):
    from . import browser
    directory = pathlib.Path(args.directory)
    if not directory.is_dir():
        print(f"error: {directory} is not a directory\n---> HINT: mkdir -p {directory}",
              file=sys.stderr)
        return 2
    if not pathlib.Path(args.chromium).exists():
        print(f"error: no browser at {args.chromium}\n---> HINT: apt-get install chromium",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="minddp-site-") as out:
        count, seconds = build(out)
        print(f"built {count} pages in {seconds:.1f} s")
        with browser.served(out) as url, browser.chromium(args.chromium) as session:
            for path in browser.screenshots(session, url, directory):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
