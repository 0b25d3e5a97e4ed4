"""The ``ftrain`` command, built on the library: its settings (``config``, ``run_settings``,
``settings_file``), its loop (``loop``, ``resume``), what a run writes (``run_folder``, ``sinks``,
``export``), the process settings it applies to itself (``process``) and the recipes that build what
it trains (``recipes``). Nothing in the library imports this package; ``python -m ftrain`` and the
``ftrain`` console script run ``ftrain.app.cli.main``.
"""
