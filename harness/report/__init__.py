"""The HTML report: one self-contained file of tables and matplotlib figures for a capture file.

    python -m harness report FILE.npz [-o OUT.html] [--figures DIR]

Layout: data.py reads the capture through harness.store.format; figures.py draws (matplotlib,
no display); html.py writes markup; sections.py composes both; build.py is the command; target.py says
where it may write (never over its input, nor over a file the report did not write).
"""
