"""The course as a site: built strictly from the repository, then read in headless Chromium.

    pytest tests/test_site.py                                # needs pip install -e ".[site]"
    MINDDP_SITE_SHOTS=docs/ pytest tests/test_site.py -k chromium    # docs/site.md's pictures

- The build is strict: a page for every file of the reading order, every exercise and every
  docs page; a link to nothing, a missing anchor or a file of the reading order that is gone
  stops it (each tried here on purpose).
- In Chromium (Debian's; one test, skipped with one line where there is none), every page loads
  without a console error or a failed request, every image shows, every internal link and
  anchor resolves (external ones are only checked to be well-formed), a lesson's comment and
  code boxes stand side by side at the same height with the file's own lines and numbers,
  and the search finds a lesson by a word of its docstring. Chromium is killed as a hang
  after LIMIT_S seconds without progress (a slow crawl goes on), and no process of it is
  left behind.
"""

import json
import os
import pathlib
import re
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from helpers import REPO
from minddp.site import build as site_build

try:
    import material  # noqa: F401
    import mkdocs  # noqa: F401
    import playwright  # noqa: F401
    EXTRA = None
except ImportError as err:
    EXTRA = f'no site extra ({err.name}): pip install -e ".[site]"'
needs_extra = pytest.mark.skipif(EXTRA is not None, reason=str(EXTRA))

CHROMIUM = os.environ.get("MINDDP_CHROMIUM", "/usr/bin/chromium")
# Against a hang only: the longest Chromium may go without a page receiving a response. The
# whole crawl took 52 s alone and 208 s in the quiet suite; a busier machine takes longer.
LIMIT_S = 300
LESSON = "minddp/ddp/naive.py"  # the lesson whose page is measured and searched for


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    count, seconds = site_build.build(out)
    print(f"built {count} pages in {seconds:.1f} s")
    return out


@needs_extra
def test_every_file_exercise_and_docs_page_has_its_page(site):
    from minddp.grader.exercises import EXERCISES
    from minddp.site.pages import parts
    files = [path for part in parts() for path in part.files]
    from test_layout import CHAPTERS  # every file of every chapter, the reading order's too
    assert {p.relative_to(REPO).as_posix() for c in CHAPTERS
            for p in (REPO / "minddp" / c).glob("*.py")} <= set(files)
    for path in files:
        page = path[:-len("__init__.py")] if path.endswith("__init__.py") else path[:-3] + "/"
        html = (site / page / "index.html").read_text()
        assert (site / "source" / f"{path}.txt").read_text() == (REPO / path).read_text()
        if not path.endswith("__init__.py"):
            assert 'class="sbs-row"' in html, path
    for name in EXERCISES:
        assert f"minddp exercise {name}" in (site / "exercises" / name / "index.html").read_text()
    for doc in (REPO / "docs").glob("*.md"):
        assert (site / "docs" / doc.stem / "index.html").exists(), doc.name
    for picture in (REPO / "docs").glob("*.png"):
        assert (site / "docs" / picture.name).read_bytes() == picture.read_bytes()


@needs_extra
def test_a_broken_link_a_missing_anchor_or_a_stray_page_fails_the_build(tmp_path):
    docs = tmp_path / "pages"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#a-heading) [gone](gone.md)\n"
                                   "[no anchor](other.md#no-such-heading)\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n")
    (docs / "stray.md").write_text("# Not in the navigation\n")
    with pytest.raises(site_build.BuildFailed) as failed:
        site_build.run_mkdocs(docs, tmp_path / "out", ["index.md", "other.md"])
    problems = "\n".join(failed.value.args[0])
    assert "'gone.md'" in problems and "no-such-heading" in problems and "stray.md" in problems
    assert "a-heading'" not in problems
    (docs / "stray.md").unlink()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#a-heading)\n")
    site_build.run_mkdocs(docs, tmp_path / "out", ["index.md", "other.md"])  # now it builds


@needs_extra
def test_a_file_of_the_reading_order_renamed_fails_the_build(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "minddp", root / "minddp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("examples", "docs", "README.md"):
        (root / name).symlink_to(REPO / name)
    (root / LESSON).rename(root / LESSON.replace(".py", "_ddp.py"))
    with pytest.raises(site_build.BuildFailed, match="naive.py"):
        site_build.build(tmp_path / "out", root=root)


def test_a_file_is_cut_into_sections_prose_beside_its_code():
    from minddp.site.side_by_side import sections
    source = ('"""The module."""\n\nimport os\n\n\ndef f(): """a one-liner stays code"""\n\n\n'
              '# Why g:\n# two lines.\n@staticmethod\ndef g(x):\n    """G\'s own doc.\n\n'
              '        an indented block\n    """\n    return x  # why, on its line\n\n\n'
              'class A:\n    """A."""\n    # inside\n    y = 1\n')
    found = [(s.prose, [n for n, _ in s.code]) for s in sections(source, source.splitlines())]
    assert found == [
        (["The module."], [3, 4, 5, 6]),
        (["Why g:", "two lines.", "", "G's own doc.", "", "    an indented block"], [11, 12, 17]),
        (["A."], [20]),
        (["inside"], [23])]
    assert sections(source, source.splitlines())[1].code[-1][1].endswith("# why, on its line")


def test_prose_stays_plain_text_its_paths_linked():
    from minddp.site.side_by_side import prose_markdown
    pages = {"minddp/ddp/naive.py": "../ddp/naive.md"}
    text = prose_markdown(["Read minddp/ddp/naive.py and `minddp/ddp/naive.py`: __init__,",
                           "f(*args, **kwargs), the *average*, a <b> and [x](y):",
                           "    code", "- a list at once"], pages.get)
    assert text.splitlines() == [
        "Read [`minddp/ddp/naive.py`](../ddp/naive.md) and"
        " [`minddp/ddp/naive.py`](../ddp/naive.md): \\_\\_init\\_\\_,",
        "f(\\*args, \\*\\*kwargs), the *average*, a &lt;b\\> and \\[x\\](y):",
        "", "    code", "", "- a list at once"]


def test_the_command_without_its_extra_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mkdocs", None)  # as if not installed
    assert site_build.main(["build", "--out", str(pathlib.Path("build") / "no-site")]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == '---> HINT: pip install -e ".[site]"', err
    assert len(err.splitlines()) == 2


def test_a_bad_command_is_refused_in_one_line(capsys):
    for argv in (["bulid"], ["build", "--port", "1"], [], ["build", "--out", str(REPO / "docs")]):
        with pytest.raises(SystemExit) as exit_:
            sys.exit(site_build.main(argv))
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 2, err


# In the browser: one test, every check run and each failure named, so that a machine
# without Chromium skips it in one line.

@needs_extra
def test_the_site_as_a_reader_sees_it_in_headless_chromium(site, tmp_path):
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM}: apt-get install chromium (CI installs it)")
    from minddp.site import browser
    profile = tmp_path / "chromium"
    profile.mkdir()
    shots = pathlib.Path(os.environ.get("MINDDP_SITE_SHOTS") or tmp_path)
    failures = []
    with browser.served(site) as url, browser.chromium(CHROMIUM, LIMIT_S, profile) as session:
        crawl = _crawl(site, url, session)
        checks = {
            "every page loads without a console error": lambda: _no_error(crawl),
            "every image and link resolves": lambda: _resolves(crawl, url),
            "a lesson shows comment and code side by side": lambda: _side_by_side(url, session),
            "the search finds a lesson by a word of its docstring":
                lambda: _search(site, url, session),
            "screenshots of three pages": lambda: _screenshots(url, session, shots),
        }
        for name, check in checks.items():
            try:
                check()
            except AssertionError as err:
                failures.append(f"{name}: {err}")
    assert not _alive(profile), "a chromium process was left behind"
    assert not failures, "\n".join(failures)


@needs_extra
def test_chromium_is_stopped_by_a_page_that_never_answers_not_by_a_slow_crawl(tmp_path):
    """The bound is on progress, not on the whole: pages answered slowly, one after another,
    for longer in all than the bound, are read to the end; then a page that never answers is
    a hang, named, and no Chromium process is left."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM}: apt-get install chromium (CI installs it)")
    import http.server
    import threading
    import time
    from minddp.site import browser
    bound, pages, step = 12, 5, 3.5  # 5 pages answered 3.5 s late: 17.5 s in all

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/never":  # past the bound; no answer then, the reader is gone
                time.sleep(60)
                return
            time.sleep(step)
            body = b"<!doctype html><title>slow</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)  # daemon threads
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    profile = tmp_path / "chromium"
    profile.mkdir()
    try:
        with pytest.raises(TimeoutError, match=f"killed after {bound} s without progress"):
            with browser.chromium(CHROMIUM, bound, profile) as session:
                start = time.monotonic()
                page = browser.open_page(session, f"{url}/0", [])
                for i in range(1, pages):
                    page.goto(f"{url}/{i}", wait_until="load")
                read = time.monotonic() - start
                page.goto(f"{url}/never", wait_until="load")
    finally:
        server.shutdown()
        server.server_close()
    assert read > bound, read  # the slow pages outlasted the bound, and were read
    assert not _alive(profile), "a chromium process was left behind"


def _alive(profile):
    """The live processes (not zombies) whose command line names `profile`."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if str(profile) in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and state != "Z":
                found.append(proc.name)
        except (OSError, IndexError):
            continue
    return found


def _crawl(site, url, session):
    """Every page of the site opened once: {url: (errors, ids, links, broken images)}."""
    from minddp.site.browser import open_page
    pages = sorted(p.relative_to(site).parent.as_posix() + "/"
                   for p in site.rglob("index.html"))
    found, errors = {}, []
    page = open_page(session, url, errors)
    for path in pages:
        target = url + ("" if path == "./" else path)
        errors.clear()
        page.goto(target, wait_until="load")
        seen = page.evaluate("""() => ({
            ids: [...document.querySelectorAll('[id]')].map(e => e.id),
            links: [...document.querySelectorAll('a[href]')].map(a => a.href),
            images: [...document.querySelectorAll('img')]
                .filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)})""")
        found[target] = (list(errors), set(seen["ids"]), seen["links"], seen["images"])
    page.close()
    return found


def _no_error(crawl):
    assert len(crawl) > 100, len(crawl)
    bad = {url: errors for url, (errors, _, _, _) in crawl.items() if errors}
    assert not bad, bad


def _resolves(crawl, url):
    assert not {u: images for u, (_, _, _, images) in crawl.items() if images}
    checked, bad = {}, []
    for where, (_, _, links, _) in crawl.items():
        for link in links:
            parts = urllib.parse.urlsplit(link)
            if not link.startswith(url):  # external: well-formed, never fetched
                if not (parts.scheme in ("http", "https") and parts.netloc):
                    bad.append((where, link))
                continue
            target = urllib.parse.urlunsplit(parts._replace(fragment=""))
            if target in crawl:
                ok = not parts.fragment or urllib.parse.unquote(parts.fragment) in crawl[target][1]
            else:
                if target not in checked:
                    checked[target] = _status(target) == 200
                ok = checked[target]
            if not ok:
                bad.append((where, link))
    assert not bad, bad[:10]
    assert any(u.endswith(".txt") for u in checked), "the plain copies were never linked"


def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=LIMIT_S) as answer:  # a hang's bound only
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def _side_by_side(url, session):
    from minddp.site.browser import open_page
    errors = []
    page = open_page(session, url + LESSON[:-3] + "/", errors)
    rows = page.evaluate("""() => [...document.querySelectorAll('.sbs-row')].map(row => {
        const box = e => { const r = e.getBoundingClientRect();
                           return [r.left, r.top, r.width, r.height]; };
        return {prose: box(row.querySelector('.sbs-prose')),
                code: box(row.querySelector('.sbs-code')),
                text: row.querySelector('.sbs-prose').innerText,
                lines: [...row.querySelectorAll('.sbs-line')].map(
                    l => [l.id, l.querySelector('.sbs-n').innerText,
                          l.innerText.slice(l.querySelector('.sbs-n').innerText.length)])};
    })""")
    page.close()
    assert len(rows) > 5 and not errors, (len(rows), errors)
    source = (REPO / LESSON).read_text().splitlines()
    shown = 0
    for row in rows:
        (pl, pt, pw, ph), (cl, ct, cw, ch) = row["prose"], row["code"]
        assert abs(pt - ct) < 0.5 and abs(ph - ch) < 0.5, row  # one height, side by side
        assert pl + pw <= cl + 0.5 and pw > 150 and cw > 300, row
        for anchor, number, text in row["lines"]:  # the file's own lines, numbered
            assert anchor == f"L{number}" and text == source[int(number) - 1], (number, text)
            shown += 1
    assert rows[0]["text"].startswith(source[0].strip('"'))  # the docstring beside the code
    assert all(row["text"].strip() for row in rows)  # every section opens with its prose
    assert shown > len(source) // 2


def _search(site, url, session):
    import ast
    from minddp.site.browser import open_page
    from minddp.site.side_by_side import sections
    index = json.loads((site / "search" / "search_index.json").read_text())["docs"]
    source = (REPO / LESSON).read_text()
    doc = ast.get_docstring(ast.parse(source))

    def pages_with(word):
        return len({d["location"].split("#")[0] for d in index
                    if word.lower() in d["text"].lower()})
    word = min(sorted(set(re.findall(r"[A-Za-z]{6,}", doc))), key=pages_with)  # the rarest
    lesson = " ".join(d["text"] for d in index if d["location"].startswith(LESSON[:-3] + "/"))
    assert doc.splitlines()[0] in lesson
    lines = source.splitlines()
    code = [lines[n - 1].strip() for section in sections(source, lines) for n, _ in section.code]
    code = [line for line in code if len(line) > 30 and not set("<>&'\"") & set(line)]
    assert code and not [line for line in code if line in lesson]  # the code is kept out
    errors = []
    page = open_page(session, url, errors)
    # Typed key by key, as a reader does: Material reads the box on a keyup, a focus or its
    # index being ready. fill() sends none once the focus has been read, so beside six busy
    # loops 5 of 25 searches never ran (typed: 25 of 25 found the lesson).
    page.locator("input.md-search__input").press_sequentially(word)
    page.wait_for_selector(".md-search-result__item a")
    hrefs = page.eval_on_selector_all(".md-search-result__item a", "as => as.map(a => a.href)")
    page.close()
    assert any(h.split("#")[0] == url + LESSON[:-3] + "/" for h in hrefs), (word, hrefs)
    assert not errors, errors


def _screenshots(url, session, directory):
    # MINDDP_SITE_SHOTS=docs/ makes docs/site.md's pictures (minddp site shots docs/: the same)
    from minddp.site import browser
    written = browser.screenshots(session, url, directory)
    assert [p.name for p in written] == list(browser.SHOTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
