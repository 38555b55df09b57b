"""The command-line programs, one module per program, each with ``build_parser()`` and
``main(argv=None) -> int``.

They sit on top of every other package (nothing in megazero imports them). Installed, each is
a console script (``megazero-pretrain-gpt``, ``megazero-preprocess-data``, ...,
``[project.scripts]`` in pyproject.toml); from a checkout, ``pretrain_gpt.py`` and
``tools/<name>.py`` are thin scripts that call the same ``main``.
"""
