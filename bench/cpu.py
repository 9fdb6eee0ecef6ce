"""CPU benchmark: ``python bench/cpu.py [--quick] [--no-compile]`` (the same as ``vega bench``)."""
import sys

from vega.bench import main

if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv, compile_torch="--no-compile" not in sys.argv))
