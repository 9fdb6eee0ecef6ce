"""The Triton backend: fused multi-tensor GPU kernels, one launch per phase per dtype group.

Each program and dtype group (parameter, gradient and state dtypes) renders to
one Python module of ``@triton.jit`` kernels (``vega show --backend triton``),
from the Jinja2 template ``templates/triton.py.j2``. A launch covers every
tensor of the group: a device table holds each tensor's addresses (numel, p,
g, state..., step counter, hyperparameters, outputs) and a block map gives
each program BLOCK consecutive elements of one tensor. A step is:

- ``<name>_prelude`` and ``<name>_prelude_finish``: the gradients' sum of
  squares and non-finite count, unscaled, added into ``pre``;
- ``<name>_phase<k>`` and ``<name>_finish<k>``: per-tensor reductions
  (``norm``, ``sum``, ``mean``, ``max``), per block then per tensor in block
  order (deterministic); values needed on both sides are recomputed;
- ``<name>_update``: the scalar phase (float64, once per program, as in the
  reference) and the element program; every write is ``where(finite, new, old)``;
- ``<name>_advance``: the step counters plus one (saturating), unless skipped.

Nothing is read back to the host: the learning rate, step, loss scale, clip
coefficient and finite flag are device values, so a step replays under CUDA
graphs. The step runs as the torch custom op ``vega::triton_step`` (see
``vega.codegen.triton_runtime``), so ``torch.compile(fullgraph=True)`` traces it.

On CPU tensors the kernels run under Triton's interpreter: set
``TRITON_INTERPRET=1`` before the first step (``@triton.jit`` reads it when
the kernels are loaded); without it, CPU tensors raise a ValueError that says
so. The interpreter truncates
float32 -> bfloat16 casts, so bfloat16 results are rounded to nearest even by
``to_bf16`` explicitly; ``b ^ t`` is ``exp2(t * log2(b))`` (``vpow``), since
``libdevice.pow`` does not run under the interpreter.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
from functools import cache
from importlib.resources import files

import torch

from vega.codegen import reference, triton_runtime
from vega.codegen.base import Linear, Renderer, linearize, safe
from vega.codegen.base import reduction_phases
from vega.dsl.ir import LEAVES, REDUCTIONS, Kind, Node, Op, Program, walk

TL = {"float32": "tl.float32", "float64": "tl.float64", "bfloat16": "tl.bfloat16",
      "float16": "tl.float16"}

# names the kernels use for themselves; a spec value with one of these names is renamed
INTERNAL = {"triton", "tl", "pid", "i", "row", "offsets", "mask", "inv_scale", "coef", "finite",
            "table_ptr", "block_tensor_ptr", "block_start_ptr", "pre_ptr", "red_ptr", "part_ptr",
            "step_ptr", "hyper_ptr", "HAS_PRE", "BLOCK", "ROW", "NRED", "NUMEL", "STEP", "HYPER",
            "vpow", "to_bf16", "nanmax", "read_prelude"}


def _call(name):
    return lambda self, node, phase, *a: f"{name}({', '.join(a)})"


def _minmax(which):
    return lambda self, node, phase, a, b: \
        f"tl.{which}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"


def _logic(node, a, b, op, mixed):
    """``a & b`` where both are blocks or both scalars; the interpreter cannot combine a
    block of bools with a scalar bool, so mixed operands go through ``tl.where``."""
    blocks = {s.kind == Kind.ELEMENT for s in node.src}
    return f"{a} {op} {b}" if len(blocks) == 1 else mixed


def _pow(self, node, phase, a, b):
    base, expo = node.src
    if expo.op is Op.CONST and expo.arg == 2.0:
        return f"{a} * {a}"
    if expo.op is Op.CONST and expo.arg == 0.5:
        return self.code_for_op[Op.SQRT](self, node, phase, a)
    return f"vpow({self.tensor(base, a, phase)}, {self.tensor(expo, b, phase)})"


class TritonRenderer(Renderer):
    """Triton expressions; the scalar phase in float64, the element phase in ``ct``."""

    code_for_op = {
        Op.NEG: lambda self, node, phase, a: f"-{a}",
        Op.POW: _pow,
        Op.AND: lambda self, node, phase, a, b: _logic(node, a, b, "&",
                                                       f"tl.where({a}, {b}, False)"),
        Op.OR: lambda self, node, phase, a, b: _logic(node, a, b, "|",
                                                      f"tl.where({a}, True, {b})"),
        Op.NOT: lambda self, node, phase, a: f"~{a}",
        Op.WHERE: _call("tl.where"),
        Op.SQRT: lambda self, node, phase, a: (
            f"tl.sqrt_rn({a})" if phase == "element" and self.ct == "tl.float32"
            else f"tl.sqrt({a})"),
        Op.RSQRT: lambda self, node, phase, a: (
            f"tl.rsqrt({a})" if phase == "element" else f"1.0 / tl.sqrt({a})"),
        Op.EXP: _call("tl.exp"),
        Op.LOG: _call("tl.log"),
        Op.ABS: _call("tl.abs"),
        Op.SIGN: lambda self, node, phase, a:
            f"tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, {a}))",
        Op.MIN: _minmax("minimum"),
        Op.MAX: _minmax("maximum"),
    }

    def __init__(self, ct: str, rename: dict[str, str]):
        self.ct, self.rename = ct, rename

    def const(self, value) -> str:
        if isinstance(value, bool):
            return repr(value)
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(float(value))

    def operand(self, linear: Linear, node: Node, phase: str = "element") -> str:
        if node.op is Op.CONST:
            return self.const(node.arg)
        name = linear.ref(node)
        return self.rename.get(name, name)

    def tensor(self, node: Node, text: str, phase: str) -> str:
        """An operand as a Triton value: a literal becomes a 0-d tensor."""
        if node.op is not Op.CONST:
            return text
        return f"tl.full((), {text}, {'tl.float64' if phase == 'scalar' else self.ct})"


def _needed(roots: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:
    """The element-phase lines reaching ``roots`` (operands first), the reductions of earlier
    phases they read (values are recomputed, reductions are not), and every node reached."""
    seen: set[int] = set()
    stack, needed = list(roots), []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        needed.append(node)
        if node.op in REDUCTIONS and not any(node is r for r in roots):
            continue
        stack.extend(node.src)
    order = {id(n): k for k, n in enumerate(walk(roots))}
    needed.sort(key=lambda n: order[id(n)])
    lines = [n for n in needed if n.kind >= Kind.TENSOR and n.op not in LEAVES
             and n.op not in REDUCTIONS]
    earlier = [n for n in needed if n.op in REDUCTIONS and not any(n is r for r in roots)]
    return lines, earlier, needed


_WHAT = {Op.NORM: "norm", Op.SUM: "sum", Op.MEAN: "mean", Op.AMAX: "max"}


class Source:
    """The Triton source of one program for one dtype group."""

    def __init__(self, program: Program, pdt: str, gdt: str, sdt: str):
        self.program, self.lin = program, linearize(program)
        self.dtypes = (pdt, gdt, sdt)
        self.ct = "tl.float64" if pdt == "float64" else "tl.float32"
        self.phases = reduction_phases(program)
        self.slots = {id(n): j for j, n in enumerate(n for ph in self.phases for n in ph)}
        self._names()
        self.r = TritonRenderer(self.ct, self.rename)

    # -- names ----------------------------------------------------------------
    def _names(self) -> None:
        lin, prog = self.lin, self.program
        taken = set(INTERNAL)
        self.rename: dict[str, str] = {}

        def claim(name: str, spec: bool = False) -> str:
            """A free identifier for ``name``; a spec's value renamed where it collides."""
            new, k = name, 0
            while new in taken:
                k += 1
                new = f"{name}_{k}" if k > 1 else f"{name}_v"
            taken.add(new)
            if spec and new != name:
                self.rename[name] = new
            return new

        for name in ["p", "g", "t", *lin.hypers, *(safe(s) for s in prog.state_names)]:
            claim(name, spec=True)
        self.targets = ["p", *(safe(s) for s in prog.state_names)]  # table order
        v = self.var
        self.cols: list[dict] = [{"name": "NUMEL", "comment": "number of elements"}]
        self.col = {}

        def column(key, base, comment):
            name = claim(base.upper())
            self.col[key] = name
            self.cols.append({"name": name, "comment": comment})

        column("p", "P", "parameter")
        column("g", "G", "gradient")
        for s in prog.state_names:
            column(safe(s), f"S_{safe(s)}", f"state {s}")
        self.col["step"], self.col["hyper"] = "STEP", "HYPER"
        self.cols.append({"name": "STEP", "comment": "int32 step counter (completed steps)"})
        hyp = ", ".join(prog.float_hypers) or "none"
        self.cols.append({"name": "HYPER", "comment": f"float64 hyperparameters: {hyp}"})
        for x in self.targets:
            column(f"{x}_out", f"{self.col[x]}_OUT",
                   f"new {'parameter' if x == 'p' else 'state ' + x} (= {self.col[x]} in place)")
        for k, col in enumerate(self.cols):
            col["index"] = k
        self.ptr = {x: claim(f"{v(x)}_ptr") for x in ("p", "g", *self.targets[1:])}
        self.out_ptr = {x: claim(f"{v(x)}_out_ptr") for x in self.targets}
        self.stored = {x: claim(f"{v(x)}_stored") for x in self.targets}
        for line in lin.scalar_lines + lin.element_lines:
            claim(line.var, spec=True)
        self.partname = [claim(f"part{q}") for q in range(max(map(len, self.phases), default=0))]
        self.acc = [claim(f"acc{q}") for q in range(len(self.partname))]

    def var(self, name: str) -> str:
        return self.rename.get(name, name)

    # -- kernels --------------------------------------------------------------
    def _kernel(self, roots: list[Node], update: bool) -> dict:
        lin, r, v = self.lin, self.r, self.var
        lines, earlier, needed = _needed(roots)
        used = {"p" if n.op is Op.PARAM else "g" if n.op is Op.GRAD else safe(n.arg)
                for n in needed if n.op in (Op.PARAM, Op.GRAD, Op.STATE)}
        # the scalars the element lines read (rounded once to ct), and the scalar lines they need
        readers = [n for n in needed if n.kind >= Kind.TENSOR and not any(n is e for e in earlier)]
        rounded = {id(s): s for m in readers for s in m.src
                   if s.kind <= Kind.SCALAR and s.op is not Op.CONST}
        if update:
            rounded.update({id(n): n for _, n in self.program.updates
                            if n.kind <= Kind.SCALAR and n.op is not Op.CONST})
        rounded = list(rounded.values())
        scalar_nodes = {id(n): n for n in walk(rounded) if n.op is not Op.CONST}
        hyper_names = {n.arg for n in scalar_nodes.values() if n.op is Op.HYPER}
        hypers = [(k, h) for k, h in enumerate(self.program.float_hypers) if h in hyper_names]
        need_t = any(n.op is Op.T for n in scalar_nodes.values())
        pointers = []
        for x in ("p", "g", *self.targets[1:]):
            if x in used or (update and x != "g"):
                dt = self.dtypes[0 if x == "p" else 1 if x == "g" else 2]
                pointers.append(f"{self.ptr[x]} = tl.load(row + {self.col[x]})"
                                f".to(tl.pointer_type({TL[dt]}))")
        if update:
            for x in self.targets:
                dt = self.dtypes[0 if x == "p" else 2]
                pointers.append(f"{self.out_ptr[x]} = tl.load(row + {self.col[x + '_out']})"
                                f".to(tl.pointer_type({TL[dt]}))")
        if need_t:
            pointers.append("step_ptr = tl.load(row + STEP).to(tl.pointer_type(tl.int32))")
        if hypers:
            pointers.append("hyper_ptr = tl.load(row + HYPER).to(tl.pointer_type(tl.float64))")
        scalar = []
        if need_t:
            scalar.append(f"{v('t')} = tl.load(step_ptr).to(tl.float64) + 1.0")
        for k, h in hypers:
            scalar.append(f"{v(safe(h))} = tl.load(hyper_ptr + {k})")
        for line in lin.scalar_lines:
            if id(line.node) in scalar_nodes:
                scalar.append(f"{v(line.var)} = {r.expr(lin, line.node, 'scalar')}")
        round_lines = [f"{r.operand(lin, n)} = {r.operand(lin, n)}.to({self.ct})"
                       for n in rounded if n.dtype == "float" and self.ct != "tl.float64"]
        loads = []
        for x in self.targets if update else []:
            loads.append(f"{self.stored[x]} = tl.load({self.ptr[x]} + offsets, mask=mask)")
        for x in ("p", "g", *self.targets[1:]):
            if x not in used:
                continue
            if x == "g":
                loads.append(f"{v('g')} = tl.load({self.ptr['g']} + offsets, mask=mask)"
                             f".to({self.ct}) * inv_scale * coef")
            elif update:
                loads.append(f"{v(x)} = {self.stored[x]}.to({self.ct})")
            else:
                loads.append(f"{v(x)} = tl.load({self.ptr[x]} + offsets, mask=mask)"
                             f".to({self.ct})")
        body = []
        for n in earlier:
            body.append(f"{r.operand(lin, n)} = tl.load(red_ptr + i * NRED + "
                        f"{self.slots[id(n)]}).to({self.ct})  # {_WHAT[n.op]} from phase "
                        f"{self._phase_of(n)}")
        for n in lines:
            body.append(f"{r.operand(lin, n)} = {r.expr(lin, n, 'element')}")
        return {"pointers": pointers, "scalar": scalar, "rounded": round_lines,
                "loads": loads, "lines": body, "part": not update, "scaled": "g" in used,
                "nparts": len(roots) if not update else 0}

    def _phase_of(self, node: Node) -> int:
        return next(k for k, ph in enumerate(self.phases) if any(n is node for n in ph))

    def _phase(self, k: int, phase: list[Node]) -> dict:
        kernel = self._kernel(phase, update=False)
        lin, r, np_ = self.lin, self.r, len(phase)
        partials, acc_init, acc_step, results = [], [], [], []
        for q, node in enumerate(phase):
            x = r.operand(lin, node.src[0])
            name, part, acc = r.operand(lin, node), self.partname[q], self.acc[q]
            at = f"part_ptr + pid * {np_} + {q}"
            if node.op is Op.AMAX:
                partials.append(f"{part} = tl.where(mask, {x}, float(\"-inf\")).to(tl.float64)")
                partials.append(f"tl.store({at}, nanmax({part}))  # {name}: max({x})")
                acc_init.append(f"{acc} = tl.full([BLOCK], float(\"-inf\"), tl.float64)")
                acc_step.append(f"part = tl.load(part_ptr + blocks * {np_} + {q}, mask=mask, "
                                "other=float(\"-inf\"))")
                acc_step.append(f"{acc} = tl.maximum({acc}, part, "
                                "propagate_nan=tl.PropagateNan.ALL)")
            else:
                partials.append(f"{part} = tl.where(mask, {x}, 0.0).to(tl.float64)")
                total = f"{part} * {part}" if node.op is Op.NORM else part
                partials.append(f"tl.store({at}, tl.sum({total}))  # {name}: "
                                f"{_WHAT[node.op]}({x})")
                acc_init.append(f"{acc} = tl.zeros([BLOCK], dtype=tl.float64)")
                acc_step.append(f"{acc} += tl.load(part_ptr + blocks * {np_} + {q}, mask=mask, "
                                "other=0.0)")
            value = {Op.NORM: f"tl.sqrt(tl.sum({acc}))", Op.SUM: f"tl.sum({acc})",
                     Op.MEAN: f"tl.sum({acc}) / numel",
                     Op.AMAX: f"nanmax({acc})"}[node.op]
            results.append(f"tl.store(red_ptr + i * NRED + {self.slots[id(node)]}, {value})"
                           f"  # {name}")
        if any(n.op is Op.MEAN for n in phase):
            results.insert(0, "numel = tl.load(table_ptr + i * ROW + NUMEL).to(tl.float64)")
        what = ", ".join(f"{_WHAT[n.op]}" for n in phase)
        return {"k": k, "kernel": kernel, "partials": partials, "acc_init": acc_init,
                "acc_step": acc_step, "results": results, "what": what}

    def _update(self) -> dict:
        kernel = self._kernel([n for _, n in self.program.updates], update=True)
        lin, r = self.lin, self.r
        new = {safe(t) if t != "p" else "p": n for t, n in self.program.updates}
        stores = []
        for x in self.targets:
            st = self.dtypes[0 if x == "p" else 2]
            if x not in new:  # not updated by the program: the old value, as it was
                stores.append(f"tl.store({self.out_ptr[x]} + offsets, {self.stored[x]}, "
                              "mask=mask)")
                continue
            node = new[x]
            value = r.operand(lin, node)
            if node.op is Op.CONST:
                value = f"tl.full([BLOCK], {value}, {self.ct})"
            elif node.kind < Kind.ELEMENT:  # one value per tensor: as a block
                stores.append(f"{value} = {value} + tl.zeros([BLOCK], dtype={self.ct})")
            if st == "bfloat16":
                value = f"to_bf16({value})"
            elif TL[st] != self.ct:
                value = f"{value}.to({TL[st]})"
            stores.append(f"tl.store({self.out_ptr[x]} + offsets, tl.where(finite, {value}, "
                          f"{self.stored[x]}), mask=mask)")
        kernel["stores"] = stores
        return kernel

    def text(self) -> str:
        pdt, gdt, sdt = self.dtypes
        prog = self.program
        flags = ", ".join(f"{k}={str(v).lower()}" for k, v in prog.flags) or "none"
        nodes = walk(n for _, n in prog.updates)
        return _template().render(
            name=safe(prog.name), flags=flags, pdt=pdt, gdt=gdt, sdt=sdt, ct=self.ct[3:],
            ctl=self.ct,
            gct="tl.float64" if gdt == "float64" else "tl.float32", gtl=TL[gdt],
            columns=self.cols, nred=len(self.slots),
            needs_pow=any(n.op is Op.POW for n in nodes),
            needs_bf16="bfloat16" in (pdt, sdt),
            needs_nanmax=any(n.op is Op.AMAX for n in nodes),
            phases=[self._phase(k, ph) for k, ph in enumerate(self.phases)],
            update=self._update())


@cache
def _template():
    import jinja2

    text = files("vega.codegen").joinpath("templates", "triton.py.j2").read_text()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    return env.from_string(text)


class Kernel:
    """The Triton kernels of one program: one module per dtype group, built on first use."""

    backend = "triton"

    def __init__(self, program: Program):
        self.program = program
        self._reference = reference.Kernel(program)
        self.phase_sizes = [len(p) for p in reduction_phases(program)]
        self.nred = sum(self.phase_sizes)
        text = self.source()
        self.key = f"{safe(program.name)}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"
        self._modules: dict[tuple, dict] = {}
        triton_runtime.register(self)

    def source(self, dtypes=("float32", "float32", "float32")) -> str:
        return Source(self.program, *dtypes).text()

    def module(self, dtypes: tuple[str, str, str]) -> dict:
        """The namespace of the loaded module for a dtype group (interpreted or not)."""
        key = (dtypes, triton_runtime.interpreting())
        if key not in self._modules:
            self._modules[key] = triton_runtime.load_module(
                self.source(dtypes), f"{self.key}-{'-'.join(dtypes)}")
        return self._modules[key]

    def init(self, p, values, state_dtype):
        return self._reference.init(p, values, state_dtype)

    def prelude(self, grads, pre: torch.Tensor) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``."""
        triton_runtime.prelude(self, grads, pre)

    def __call__(self, params, grads, states, steps, values, donate, pre=None):
        """The same contract as ``vega.codegen.reference.Kernel.__call__``."""
        return triton_runtime.step(self, params, grads, states, steps, values, donate, pre)


def available() -> bool:
    """Whether triton is installed here (without importing it)."""
    return importlib.util.find_spec("triton") is not None
