"""The entry point of `python -m hf_contextpar.bench` (and under torchrun); the benchmark itself lives in
`hf_contextpar.tools.bench`."""

from .tools.bench import main

if __name__ == "__main__":
    main()
