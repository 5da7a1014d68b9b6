"""daskdag's benchmarks: ``python -m benchmarks [--quick]`` runs every scenario (``__main__.py``).

``scenarios/``  one module per scenario, each declaring it once (what it runs, on which
                clusters, its report section and plot); ``scenarios/__init__.py`` lists them.
``common.py``   what the scenarios share: timing, the clusters, the machine's description.
``report.py``   the results as Markdown and PNGs: tables, ratio rule, summary, generic section
                and plot.
``tools/``      standalone scripts, not scenarios, each run as its docstring says.
``results/``    the latest full run (``latest.json``, ``latest.md``, the PNGs).
"""
