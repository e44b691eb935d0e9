"""The site: the course as web pages, built from the lesson files and docs/, never copied.

    minddp site build            # the site, strictly, into build/site/ (git ignores it)
    minddp site serve            # build it, then open http://127.0.0.1:8000/
    pytest tests/test_site.py    # built, opened in headless Chromium, checked as a reader sees it

For a teacher and a student who read the course in a browser: a section per chapter in
the reading order, every lesson side by side (its docstring and comments beside the lines
they explain), the docs pages and pictures, each exercise and what the grader says:
    side_by_side.py  a lesson file cut into sections: prose left, code right, its line numbers
    pages.py         every page written from the repository: home, chapters, lessons, exercises
    build.py         `minddp site`: MkDocs (Material theme) builds the pages, strictly
    browser.py       the site served here and opened in headless Chromium; the screenshots
It sits above every chapter and reads the grader's table of exercises; nothing imports it.
Needs the site extra: pip install -e ".[site]" (docs/site.md).
"""
