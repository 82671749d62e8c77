"""The tools apart from the engine: the command line (`python -m hf_contextpar`, the `hf-contextpar` script),
the benchmark, the self-test, the cost-model prediction and calibration, the built-in models and the
simulated ranks. They use the engine's public names only; the engine never imports them."""
