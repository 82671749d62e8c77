"""The model census: every decoder-only family of the installed transformers against one process
(`run.py`, `python -m dev.census`), its tiny configs (`configs.py`), the sweep of every strategy at one N
(`sweep.py`) and the pages it writes (`report.py`: docs/census.md, patches/verified.py, README's block)."""
