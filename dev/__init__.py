"""The workshop: what studies the library and writes its documentation, run from a checkout (the repository
root on the path: `python -m dev.census`, `python dev/profile_decode.py`). None of it is installed: the wheel
carries what users run (`hf_contextpar`, `patches`, `eval`)."""
