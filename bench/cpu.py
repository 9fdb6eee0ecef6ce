"""CPU benchmark: ``python bench/cpu.py [--quick] [--no-compile] [--repeat N]``, the same
as ``vega bench``, with the same options."""
import argparse
import sys

from vega.cli import BENCH_HELP, add_bench_options, cmd_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python bench/cpu.py", description=BENCH_HELP)
    add_bench_options(parser)
    sys.exit(cmd_bench(parser.parse_args()))
