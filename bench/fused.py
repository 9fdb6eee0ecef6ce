"""vega's sgd (momentum 0.9), adam and adagrad raced against torch.optim's fused and foreach
steps of the same rule, on ``vega bench``'s GPT-2-like and many-small sets.

    python bench/fused.py [--budget 6]

One race a rule and set (``vega.bench.race``: rounds that step every row once in turn),
medians; then how far apart the parameters of vega's and torch's fused step are after the
race (``vega.bench.apart``: the largest difference over the largest change the steps made),
so that a step that computed less cannot win. torch's fused CPU steps are what ``vega
bench``'s second table races these rules against.
"""
from __future__ import annotations

import argparse

import torch

import vega
from vega import bench as B

RULES = ("sgd", "adam", "adagrad")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=6.0,
                        help="seconds a race may take (default 6)")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"argument --budget: {args.budget} is not a positive number of seconds")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for title, shapes in (("GPT-2-like", B.gpt2_like()), ("many-small", B.many_small(1000))):
        start, grads = B._tensors(shapes)
        for name in RULES:
            hypers, _, cls, kwargs = B.OTHERS[name]
            ours = vega.builtin(name).optimizer(B._leaves(shapes, grads), **hypers)
            torch_cls = getattr(torch.optim, cls)
            fused = torch_cls(B._leaves(shapes, grads), **kwargs, fused=True)
            foreach = torch_cls(B._leaves(shapes, grads), **kwargs, foreach=True)
            t = B.race({"vega": ours.step, "fused": fused.step, "foreach": foreach.step},
                       budget=args.budget)
            apart = B.apart(B._params(ours), B._params(fused), start)
            print(f"{title:<11} {name:<8} vega {1e3 * t['vega']:8.2f} ms   torch fused "
                  f"{1e3 * t['fused']:8.2f} ms ({t['fused'] / t['vega']:.2f}x)   torch foreach "
                  f"{1e3 * t['foreach']:8.2f} ms ({t['foreach'] / t['vega']:.2f}x)   "
                  f"apart {apart:.1e}", flush=True)


if __name__ == "__main__":
    main()
