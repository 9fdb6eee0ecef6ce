"""The ``vega`` command: check, show and list specs, run the demo."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vega.errors import SpecError

DESCRIPTION = """\
Vega: optimizers written as specs, compiled to fused kernels for PyTorch.

commands:
  vega check FILE...                   compile specs; print each file's first error, exit 1 on any
  vega show FILE|NAME [--backend B] [--set NAME=V] [--shape N,N]
                                       print the kernel a step on CPU tensors runs (C where
                                       a C compiler is found, else the reference)
  vega list                            the optimizers that ship with vega
  vega demo                            train a small classifier with vega's AdamW and SGD,
                                       an AdaBelief spec compiled on the spot and
                                       torch.optim.AdamW
  vega bench [--quick] [--no-compile] [--repeat N]
                                       time one step against torch.optim and optax, and
                                       against the machine's memory-bandwidth bound
"""


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def _seed(text: str) -> int:
    """``--seed``: an int torch's generators take, the demo's ``seed + 1`` included."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or not -2**63 <= n <= 2**64 - 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in "
                                         "[-2**63, 2**64 - 2]")
    return n


def _load(target: str):
    """The spec ``vega show`` names: a shipped spec's name is that spec, whatever the
    working directory holds (a file or directory of that name there, ``adamw`` or ``sgd/``,
    had been read in its place, and failed), with a note of how to name the path instead
    (``./adamw``); any other target is a spec file where it ends in ``.vega``, names a
    directory (``./adamw``, ``specs/mine``: no shipped name does) or exists."""
    import vega
    if target in vega.builtin_names():
        if os.path.lexists(target):
            _say(f"vega: {target} is the shipped spec's name (for the {target} in this "
                 f"directory, write ./{target})", sys.stderr)
        return vega.builtin(target)
    if Path(target).suffix == ".vega" or any(sep and sep in target
                                             for sep in (os.sep, os.altsep)) \
            or Path(target).exists():
        return vega.compile_file(target)
    return vega.builtin(target)


def _parse_flags(pairs: list[str], hypers) -> dict[str, bool | float | str]:
    """``--set NAME=V`` values, typed by the spec's hyperparameters (``hypers``); an
    unknown name is left for the spec to name, with its value as given (whatever it is,
    the spec says the name is not its own, and which of its own is near; of a spec that
    takes none, that it takes none)."""
    types = {h.name: h.type for h in hypers}
    values: dict[str, bool | float | str] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        kind = types.get(name)
        if kind is None:
            values[name] = value
            continue
        if value.lower() in ("true", "false") and kind != "float":
            values[name] = value.lower() == "true"
            continue
        try:
            if kind == "bool":
                raise ValueError
            values[name] = float(value)
        except ValueError:
            hint = (f"{name} is a bool: write {name}=true or {name}=false" if kind == "bool"
                    else f"{name} is a number: write {name}=0.9, say")
            raise SystemExit(f"vega: --set {pair!r}: {hint}") from None
    return values


def _silence(stream) -> None:
    """Point ``stream`` at the null device: its reader has gone (``vega show adamw |
    head``), and what is left to write, its buffer included, goes nowhere instead of
    failing again at exit (Python's "Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


def _say(text, stream=None) -> None:
    """``print``, except that a reader that has gone silences the stream rather than
    stopping the command: ``vega check`` checks every file for its exit status."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream)
    except BrokenPipeError:
        _silence(stream)


def cmd_check(args) -> int:
    import vega
    failed = 0
    for path in args.files:
        try:
            spec = vega.compile_file(path)
        except (SpecError, FileNotFoundError) as err:  # said, and on to the next file
            _say(err, sys.stderr)
            failed += 1
            continue
        hypers = ", ".join(f"{h.name}={str(h.default).lower() if h.type == 'bool' else h.default}"
                           for h in spec.hypers)
        _say(f"{path}: ok: optimizer {spec.name}({hypers})")
    return 1 if failed else 0


def cmd_show(args) -> int:
    from vega import codegen
    try:
        spec = _load(args.target)
        shape = None
        if args.shape is not None:
            shape = _parse_shape(args.shape)
        backend = args.backend if args.backend is not None else codegen.default_backend("cpu")
        print(spec.source(backend, shape, **_parse_flags(args.set, spec.hypers)))
    except (SpecError, FileNotFoundError) as err:  # (a place in a file, as vega check says it)
        print(err, file=sys.stderr)
        return 1
    except (ValueError, TypeError) as err:
        print(f"vega: {err}", file=sys.stderr)
        return 1
    return 0


MAX_NUMEL = 2**63 - 1  # what a tensor's element count holds


def _parse_shape(text: str) -> tuple[int, ...]:
    """``--shape 512,768``: sizes >= 0 whose product a tensor's element count holds (``""``:
    a 0-d parameter; a trailing comma, ``512,``, as in a Python tuple)."""
    sizes = text.split(",") if text.strip() else []
    if len(sizes) > 1 and not sizes[-1].strip():
        sizes.pop()
    if any(not n.strip() for n in sizes):
        raise SystemExit(f"vega: --shape {text!r}: an empty size; "
                         "write sizes like 512,768")
    try:
        shape = tuple(int(n) for n in sizes)
    except ValueError:
        raise SystemExit(f"vega: --shape {text!r}: write sizes like 512,768") from None
    numel = 1
    for n in shape:
        if n < 0:
            raise SystemExit(f"vega: --shape {text!r}: a size is a whole number >= 0, got {n}")
        numel *= n
    if numel > MAX_NUMEL or any(n > MAX_NUMEL for n in shape):
        raise SystemExit(f"vega: --shape {text!r}: too large: a tensor has at most 2**63 - 1 "
                         "elements")
    return shape


def cmd_list(args) -> int:
    import vega
    rows = []
    for name in vega.builtin_names():
        spec = vega.builtin(name)
        summary = spec.doc.splitlines()[0] if spec.doc else ""
        rows.append((name, f"vega.optim.{spec.class_name}", summary))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for name, cls, summary in rows:
        print(f"{name:<{width[0]}}  {cls:<{width[1]}}  {summary}")
    return 0


def cmd_demo(args) -> int:
    from vega.demo import main as demo_main
    return demo_main(steps=args.steps, seed=args.seed)


def cmd_bench(args) -> int:
    from vega.bench import main as bench_main
    return bench_main(quick=args.quick, compile_torch=not args.no_compile, repeat=args.repeat)


DEMO_HELP = ("train a small classifier with vega's AdamW and SGD, an AdaBelief spec compiled "
             "on the spot and torch.optim.AdamW")
BENCH_HELP = "time one optimizer step against torch.optim and optax"
EPILOG = """\
exit status: 0 on success, 1 where a command fails (a spec with an error, an unknown
optimizer, a --set or --shape that cannot be read), 2 for a usage error (an unknown
command or option, a missing argument, a bad option value).
"""


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``vega bench``, which ``python bench/cpu.py`` takes too."""
    parser.add_argument("--quick", action="store_true", help="fewer tensors and optimizers")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile (slow to build)")
    parser.add_argument("--repeat", type=_positive_int, default=1, metavar="N",
                        help="run the whole comparison N times; print each ratio's median "
                        "and range (default: 1)")


def _usable_streams() -> None:
    """Standard streams every command can write to. One whose descriptor was closed when
    the command started (``vega list >&-``), which Python leaves None, is the null device
    instead: what the command writes there goes nowhere, as for a reader that has gone, and
    is no traceback at exit (``sys.stdout.flush()`` on None), and no file the command opens
    takes the descriptor. Stdout escapes what its encoding cannot spell, as stderr does."""
    for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY),
                            (2, "stderr", os.O_WRONLY)):
        if getattr(sys, name) is not None:
            continue
        null = os.open(os.devnull, flags)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, "w" if fd else "r", closefd=False))
    if getattr(sys.stdout, "errors", None) == "strict" and \
            hasattr(sys.stdout, "reconfigure"):
        # (an output encoding that cannot spell a file's name, PYTHONIOENCODING=ascii or a
        # Latin-1 locale: the name spelled with escapes, as on stderr, not a traceback)
        sys.stdout.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    _usable_streams()
    parser = argparse.ArgumentParser(prog="vega", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("check", help="compile spec files and report errors")
    p.add_argument("files", nargs="+", metavar="FILE", help="a .vega spec file; every one is "
                   "checked, and the status is 1 if any has an error")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("show", help="print the kernel a spec compiles to (by default the "
                       "one a CPU step runs)")
    p.add_argument("target", metavar="FILE|NAME",
                   help="a shipped spec's name, or a spec file (a .vega file, or a path: "
                   "./adamw for a file named as a shipped spec)")
    p.add_argument("--backend", help="reference, c or triton (default: the kernel a step on "
                   "CPU tensors runs, c where a C compiler is found, else reference)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=V",
                   help="a hyperparameter the program depends on, e.g. --set amsgrad=true, "
                   "--set momentum=0.9 for sgd's momentum buffer (repeatable)")
    p.add_argument("--shape", metavar="N,N,...", help="the kernel for a parameter of this "
                   "shape, for specs whose ifs read the shape (e.g. adafactor: --shape 512,768)")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("list", help="list the shipped optimizers")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("demo", help=DEMO_HELP)
    p.add_argument("--steps", type=int, default=400,
                   help="training steps per optimizer (default: 400)")
    p.add_argument("--seed", type=_seed, default=0,
                   help="seed of the data and the initial weights (default: 0)")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help=BENCH_HELP)
    add_bench_options(p)
    p.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    status = 0
    try:
        if args.command is None:
            parser.print_help()
        else:
            status = args.fn(args)
        sys.stdout.flush()  # here, where a reader that has gone can be told from a failure
    except BrokenPipeError:
        # the reader of the output has gone (vega show adamw | head): what it did not take
        # was not wanted, so stop quietly: 0, or the status of a command that had finished
        # (vega check, which goes on checking files, says whether any failed)
        _silence(sys.stdout)
        try:
            sys.stderr.flush()
        except BrokenPipeError:  # the same pipe (2>&1)
            _silence(sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
