"""The C source of a program over a matrix view (``AxesSource``): per-row or per-column
values and reductions, each tensor stepped through a sequence of loops over one domain
(``vega_axes_step``)."""
from __future__ import annotations

import math

from vega.codegen import plan, record
from vega.codegen.c.render import _HOW, _PARTIALS, Source, _combine, _finish
from vega.dsl.check import matrix_axes
from vega.dsl.ir import (AXIS_REDUCTIONS, DOMAIN_WORDS, DOMAINS, LEAVES, REDUCTIONS, Kind, Node,
                        Op, Program, walk)

# -- programs over a matrix view ---------------------------------------------------

NGEO = plan.NGEO  # the integers after a table row's hyperparameters: axis_geometry, line_lengths

AXES_HEADER = r"""
#define CHUNK 4096  /* positions a task of a loop over one domain takes (one partial sum) */
#define GB 1024  /* outputs an axis reduction of strided sources combines side by side */

/* the position, among the values of a smaller domain, that position i reads: i with an
   axis of length n and inner stride inner taken out (vega.codegen.base.axis_geometry) */
static inline int64_t drop(int64_t i, int64_t inner, int64_t n) {
    return DROP_EXPR;
}
""".replace("DROP_EXPR", plan.in_c(plan.DROP_EXPR))

# a domain in C names (n_rc, n_r, n_c, n_m count its values); the index maps between domains
# and the axes of axis reductions: vega.codegen.plan, spelled in C
_TAG = plan.TAG


def _index_maps() -> dict[tuple[str, str], str]:
    """(domain of a loop, smaller domain) -> the index into the smaller one's values at
    position ``{i}``: ``plan.drop_path`` in C."""
    out = {}
    for dom in plan.DOMS:
        for smaller in plan.DOMS:
            if dom != smaller and set(smaller) <= set(dom):
                at = "{i}"
                for inner, n in plan.drop_path(dom, smaller):
                    at = f"drop({at}, {inner}, {n})"
                out[dom, smaller] = at
    return out


_MAPS = _index_maps()
_AXIS = plan.AXIS  # (domain of an axis reduction's source, the axis it reduces) -> (inner, len)
_IDENT = {"max": "-INFINITY", "sum": "0", "sumsq": "0", "mean": "0"}


def line_lengths(shape, axes: tuple[int | None, int | None] | None = None) \
        -> tuple[int, int, int]:
    """For the loops over the values per element, per row and per column of a tensor of
    ``shape``: a length L such that along every run of L positions that starts at a
    multiple of L, each index map into a smaller domain (``_MAPS``) is affine with step 0
    or 1. It is the size of the domain's axes after its last matrix axis where that is
    above 1, else the size of that axis; a domain without a matrix axis maps to the others
    one to one. ``axes``: the (row, column) axes where they are not ``shape``'s own
    (``vega.codegen.base.axis_geometry``)."""
    shape = tuple(int(n) for n in shape)
    r, c = matrix_axes(shape) if axes is None else axes
    out = []
    for dom in ("rc", "r", "c"):
        kept = [a for a in range(len(shape))
                if not (a == r and "r" not in dom) and not (a == c and "c" not in dom)]
        # (the last of them, kept being in order: dynamo traces this where a compiled
        # step meets a shape first, and cannot trace max's default)
        matrix = [a for a in kept if a in (r, c)]
        last = matrix[-1] if matrix else None
        if last is None:
            out.append(max(1, math.prod([shape[a] for a in kept])))
            continue
        after = math.prod([shape[a] for a in kept if a > last])
        out.append(max(1, after if after > 1 else shape[last]))
    return tuple(out)


def materialized(program: Program) -> list[Node]:
    """The values of a program over a matrix view that ``AxesSource`` computes into a
    buffer of their domain, in the order they are computed: each axis reduction, each
    value that a value of a larger domain reads, and each written to an output of a larger
    domain."""
    nodes = walk(node for _, node in program.updates)
    doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
    found: dict[int, Node] = {}
    for node in nodes:
        if node.op in AXIS_REDUCTIONS:
            found[id(node)] = node
        elif node.kind == Kind.ELEMENT:
            for s in node.src:
                if s.kind == Kind.ELEMENT and s.op not in LEAVES and s.dom != node.dom:
                    found[id(s)] = s
    for target, node in program.updates:
        if node.kind == Kind.ELEMENT and node.op not in LEAVES and node.dom != doms[target]:
            found[id(node)] = node
    order = {id(n): k for k, n in enumerate(nodes)}
    return sorted(found.values(), key=lambda n: order[id(n)])


class AxesSource(Source):
    """The C source of a program over a matrix view (``Program.uses_axes``).

    ``vega_axes_step`` steps the tensors of the table one at a time. Per tensor, after
    the scalar phase, come stages of loops, each over the values of one domain (per
    element, row, column or matrix: ``vega.dsl.ir``); every loop is an OpenMP loop over
    its outputs with a static schedule, so a step does not depend on the thread count:

    - an axis reduction (``row_mean`` ...) is *materialized*: computed into a buffer of
      its domain, each output combining its sources in order (in double; across rows, in
      up to 8 fixed parts of the rows, each in order, the parts then in order);
    - so is any other value that a value of a larger domain reads (a broadcast), or
      that is written to an output of a larger domain;
    - a per-tensor reduction (``norm`` ...) accumulates over its argument's domain, in
      partials of CHUNK positions combined in order;
    - everything else is computed where it is used, in a loop over its own domain.

    The stages are ``vega.codegen.plan.axis_plan``'s, Triton's launches: each computes
    the values it materializes first, then its axis reductions, then its per-tensor ones.
    Every output is computed from the old
    values: a last pass writes them, by a loop per element (p, state like p), then per
    row, then per column; a position there reads its own old values, materialized ones,
    and state of a smaller domain, which only a later loop writes.
    """

    @property
    def columns(self) -> record.Columns:
        """The address table's columns, with the geometry."""
        return record.table_columns(self.nstate, NGEO)

    def __init__(self, program: Program, pdt: str, gdt: str, sdt: str):
        super().__init__(program, pdt, gdt, sdt)
        self.nodes = walk(node for _, node in program.updates)
        self.order = {id(n): k for k, n in enumerate(self.nodes)}
        self.doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
        self.mats = materialized(program)
        self.mat = {id(n): n for n in self.mats}  # materialized values, by id
        # the stages (Triton's launches are the same: ``vega.codegen.plan.axis_plan``)
        self.axes = plan.axis_plan(program)
        # a step over shards: each per-tensor reduction's slot in the reduction buffer
        self.red_slots = {id(n): q for q, n in enumerate(self.axes.reductions)}

    def _buf(self, node: Node) -> str:
        return "m_" + self.lin.ref(node)

    def _body(self, roots, dom: str, index, compute=frozenset()) -> list[str]:
        """Statements computing ``roots`` at one position of a loop over ``dom``: the leaves
        and materialized values they read, loaded (``index(d)``: the position's index into
        the values of domain ``d``), and the values in between, computed. ``compute``:
        materialized roots to compute here rather than load."""
        found: dict[int, Node] = {}
        stack = [n for n in roots if n.kind == Kind.ELEMENT]
        while stack:
            node = stack.pop()
            if id(node) in found:
                continue
            found[id(node)] = node
            if node.op not in LEAVES and (id(node) not in self.mat or id(node) in compute):
                stack.extend(s for s in node.src if s.kind == Kind.ELEMENT)
        out = []
        for node in sorted(found.values(), key=lambda n: self.order[id(n)]):
            ctype = "int" if node.dtype == "bool" else "CT"
            if node.op in LEAVES:
                out.append(self._load(node, index(node.dom)))
            elif id(node) in self.mat and id(node) not in compute:
                value = f"{self._buf(node)}[{index(node.dom)}]"
                out.append(f"const {ctype} {self._var(node)} = "
                           f"{value + ' != 0' if ctype == 'int' else value};")
            else:
                out.append(f"const {ctype} {self._var(node)} = "
                           f"{self.r.expr(self.lin, node, 'element')};")
        return out

    def _over(self, dom: str, roots, after, what: str, compute=frozenset(),
              reduce=(), raw: bool = False) -> list[str]:
        """A loop over the values of ``dom``: ``roots`` at each position ``j``, then the
        statements ``after``; ``reduce``: per-tensor reductions of the roots, accumulated
        in a partial per CHUNK positions, combined in order into their variables (``raw``:
        into their slots of ``red``, combined but not finished: a step over shards)."""
        n, maps = f"n_{_TAG[dom]}", []

        def index(d: str) -> str:
            if d == dom:
                return "j"
            if d not in maps:
                maps.append(d)
            return f"b_{_TAG[d]} + (j - lo) * s_{_TAG[d]}"

        nr = len(reduce)

        def render(index) -> list[str]:
            return self._body(roots, dom, index, compute) + list(after) + [
                _combine(_HOW[node.op], f"acc{q}", self.r.operand(self.lin, node.src[0]))
                for q, node in enumerate(reduce)]
        body = render(index)
        idents = [_IDENT[_HOW[node.op]] for node in reduce]
        out = [f"{{  /* {what} */", f"    const int64_t nch = ({n} + CHUNK - 1) / CHUNK;"]
        if reduce:
            out.append(f"    double *part = (double *)malloc(sizeof(double) * {nr} * "
                       "(size_t)(nch ? nch : 1));")
        out += [f"    #pragma omp parallel for schedule(static) num_threads(nth) "
                f"if ({n} >= PAR_MIN)",
                "    for (int64_t ch = 0; ch < nch; ch++) {"]
        if reduce:
            out.append("        double " + ", ".join(f"acc{q} = {idents[q]}"
                                                     for q in range(nr)) + ";")
        out += [f"        const int64_t hi = {n} < (ch + 1) * CHUNK ? {n} : (ch + 1) * CHUNK;",
                "        for (int64_t lo = ch * CHUNK, e; lo < hi; lo = e) {"]
        if maps:
            L = f"L_{_TAG[dom]}"
            out.append(f"            e = (lo / {L} + 1) * {L} < hi ? (lo / {L} + 1) * {L} : hi;"
                       "  /* a line: the index maps are affine */")
            for d in maps:
                m, t = _MAPS[dom, d], _TAG[d]
                out += [f"            const int64_t b_{t} = {m.format(i='lo')};",
                        f"            const int64_t s_{t} = e - lo > 1 ? "
                        f"{m.format(i='lo + 1')} - b_{t} : 0;"]
        else:
            out.append("            e = hi;")
        sums = [f"acc{q}" for q, node in enumerate(reduce) if node.op is not Op.AMAX]
        # a NaN-propagating max is no OpenMP reduction: no simd
        pragma = ["#pragma omp simd" + (f" reduction(+:{', '.join(sums)})" if sums else "")
                  ] if len(sums) == nr else []

        def loop(lines: list[str], indent: str) -> list[str]:
            return [indent + line for line in (*pragma, "for (int64_t j = lo; j < e; j++) {",
                                               *("    " + line for line in lines), "}")]
        # a value of a smaller domain is read along a line with stride 0 (the line runs
        # along its axis) or 1 (across it): versions of the loop for those strides read
        # it as one value or contiguously, not gathered
        tags = [_TAG[d] for d in maps]
        strides = {1: [(0,), (1,)], 2: [(0, 1), (1, 0)]}.get(len(tags), [])
        for v, version in enumerate(strides):
            def fixed(d: str, version=version) -> str:
                if d == dom:
                    return "j"
                k = maps.index(d)
                return f"b_{tags[k]}" + (" + (j - lo)" if version[k] else "")
            test = " && ".join(f"s_{t} == {x}" for t, x in zip(tags, version))
            out.append(f"            {'} else if' if v else 'if'} ({test}) {{")
            out += loop(render(fixed), "                ")
        if strides:
            out += ["            } else {", *loop(body, "                "), "            }"]
        else:
            out += loop(body, "            ")
        out.append("        }")
        out += [f"        part[ch * {nr} + {q}] = acc{q};" for q in range(nr)]
        out.append("    }")
        for q, node in enumerate(reduce):
            out += [f"    double r{q} = {idents[q]};",
                    "    for (int64_t k = 0; k < nch; k++) {",
                    f"        double x = part[k * {nr} + {q}];",
                    f"        {_combine(_PARTIALS[node.op], f'r{q}', 'x')}",
                    "    }",
                    f"    red[i * NRED_AXES + {self.red_slots[id(node)]}] = r{q};" if raw else
                    f"    {self._var(node)} = (CT)({_finish(node.op, f'r{q}', f'(double){n}')});"]
        if reduce:
            out.append("    free(part);")
        return out + ["}"]

    def _gather(self, node: Node, raw: bool = False) -> list[str]:
        """The loop materializing an axis reduction: output o combines its source at
        ``(o / inner * len + k) * inner + o % inner`` for k < len, in order (where
        ``inner > 1``: in up to 8 fixed parts of the k, combined in order). ``raw``: where
        the tensor's ``q_`` buffer is given (a shard holding part of the reduced axis), its
        combined but unfinished values go there, in double (a mean's sum), for the step
        over shards to combine across processes and finish into the ``m_`` buffer."""
        src = node.src[0]
        axis, how = AXIS_REDUCTIONS[node.op]
        inner, length = _AXIS[src.dom, axis]
        nout, buf, x = f"n_{_TAG[node.dom]}", self._buf(node), self.r.operand(self.lin, src)

        def at(acc: str, indent: str) -> list[str]:  # the source at x, into acc
            body = self._body([src], src.dom, lambda d: "x" if d == src.dom
                              else _MAPS[src.dom, d].format(i="x"))
            body.append(_combine("max" if how == "max" else "sum", acc, x))
            return [indent + line for line in body]
        value = "{} / (double)len" if how == "mean" else "{}"
        ident = _IDENT[how]

        def put(at: str, acc: str) -> str:
            done = f"{buf}[{at}] = (CT)({value.format(acc)});"
            return f"if (q_{buf[2:]}) q_{buf[2:]}[{at}] = {acc}; else {done}" if raw else done
        par = (f"#pragma omp parallel for schedule(static) num_threads(nth) "
               f"if ({nout} * len >= PAR_MIN)")
        return [
            f"{{  /* {buf} = {node.op.value}({x}) */",
            f"    const int64_t inner = {inner}, len = {length};",
            "    if (inner == 1) {  /* the sources of an output: one run */",
            f"        {par}",
            f"        for (int64_t o = 0; o < {nout}; o++) {{",
            f"            double acc = {ident};",
            *([] if how == "max" else ["            #pragma omp simd reduction(+:acc)"]),
            "            for (int64_t x = o * len; x < (o + 1) * len; x++) {",
            *at("acc", " " * 16),
            "            }",
            f"            {put('o', 'acc')}",
            "        }",
            "    } else if (inner > 1) {  /* GB outputs side by side, their sources by rows,",
            "        read a row of a tile at a time; with few tiles, the rows in nk parts */",
            f"        const int64_t nb = (inner + GB - 1) / GB, na = {nout} / inner;",
            "        const int64_t nk = na * nb >= 8 || len < 2 ? 1 : (len < 8 ? len : 8);",
            "        const int64_t kc = (len + nk - 1) / nk;",
            "        const int64_t tw = inner < GB ? inner : GB;  /* a tile's width */",
            "        double *part = (double *)malloc(sizeof(double) * (size_t)(na * nb * nk) "
            "* (size_t)tw);",
            f"        {par}",
            "        for (int64_t task = 0; task < na * nb * nk; task++) {",
            "            const int64_t tile = task / nk, k0 = task % nk * kc;",
            "            const int64_t a = tile / nb, b0 = tile % nb * GB;",
            "            const int64_t bn = inner - b0 < GB ? inner - b0 : GB;",
            "            const int64_t k1 = k0 + kc < len ? k0 + kc : len;",
            "            double *acc = part + task * tw;",
            f"            for (int64_t b = 0; b < bn; b++) acc[b] = {ident};",
            "            for (int64_t k = k0; k < k1; k++) {",
            "                #pragma omp simd",
            "                for (int64_t b = 0; b < bn; b++) {",
            "                    const int64_t x = (a * len + k) * inner + b0 + b;",
            *at("acc[b]", " " * 20),
            "                }",
            "            }",
            "        }",
            "        for (int64_t tile = 0; tile < na * nb; tile++) {  /* the parts, in order */",
            "            const int64_t a = tile / nb, b0 = tile % nb * GB;",
            "            const int64_t bn = inner - b0 < GB ? inner - b0 : GB;",
            "            for (int64_t b = 0; b < bn; b++) {",
            "                double r = part[tile * nk * tw + b];",
            "                for (int64_t q = 1; q < nk; q++) {",
            "                    const double y = part[(tile * nk + q) * tw + b];",
            f"                    {_combine('max' if how == 'max' else 'sum', 'r', 'y')}",
            "                }",
            f"                {put('a * inner + b0 + b', 'r')}",
            "            }",
            "        }",
            "        free(part);",
            "    }",
            "}",
        ]

    def _count(self, dom: str) -> str:
        """The number of values of a state of domain ``dom`` (``geo``: axis_geometry)."""
        return f"geo[{DOMAINS.index(dom)}]"

    def _start(self) -> list[str]:
        """Per tensor: the scalar phase, the pointers, the geometry."""
        return [line[12:] for line in self._block_start([])] + [
            "const int64_t *geo = row + COL_GEO;  /* axis_geometry, line_lengths */",
            *(f"const int64_t {name} = geo[{k}];  /* {what} */"
              for k, (name, what) in enumerate(plan.GEOMETRY))]

    def _stage(self, k: int, raw: bool = False) -> list[str]:
        """Stage ``k`` of one tensor: the values it materializes (a matrix's first: a row's
        or a column's may read one; a value reads others of its domain at its own
        position), then its axis reductions, then its per-tensor ones, which may read those
        values; after the last stage (``k == nstages``), only the values the writes read
        materialized. ``raw``: a stage of a step over shards (``vega_axes_stage<k>``): its
        reductions' partial results are left for the caller, and the per-tensor values
        they give are not computed here."""
        lin, r, level = self.lin, self.r, self.axes.level
        gathers, reds = self.axes.stage(k)  # (none after the last stage)
        here = [n for n in self.mats if level[id(n)] == k and n.op not in AXIS_REDUCTIONS]
        if not (gathers or reds or here):
            return []
        body = [f"/* stage {k + 1} */" if k < self.axes.nstages
                else "/* the values the writes read */"]
        if not raw:
            body += [f"CT {self._var(n)};" for n in reds]
        for dom in ("", "r", "c", "rc"):
            ns = [n for n in here if n.dom == dom]
            if ns:
                body += self._over(dom, ns, [f"{self._buf(n)}[j] = (CT){self._var(n)};"
                                             for n in ns],
                                   f"{', '.join(map(self._buf, ns))}: "
                                   f"{DOMAIN_WORDS[dom]}, kept", compute={id(n) for n in ns})
        for n in gathers:
            body += self._gather(n, raw)
        for dom in DOMAINS:
            rs = [n for n in reds if n.src[0].dom == dom]
            if rs:
                body += self._over(dom, [n.src[0] for n in rs], [], ", ".join(
                    f"{self._var(n)} = {n.op.value}({r.operand(lin, n.src[0])})"
                    for n in rs) + f": over {DOMAIN_WORDS[dom]}", reduce=rs, raw=raw)
        if not raw:
            body += self._known(k + 1, k + 1)
        return body

    def _known(self, lo: int, hi: int) -> list[str]:
        """The per-tensor values (not reductions) known from stage ``lo`` to ``hi``."""
        out = []
        for n in self.nodes:
            if n.kind == Kind.TENSOR and n.op not in REDUCTIONS \
                    and lo <= self.axes.level[id(n)] <= hi:
                ctype = "int" if n.dtype == "bool" else "CT"
                out.append(f"const {ctype} {self._var(n)} = "
                           f"{self.r.expr(self.lin, n, 'element')};")
        return out

    def _writes(self) -> list[str]:
        """The last pass: every output, from the old values."""
        body = ["/* the writes, from the old values */"]
        for dom in ("rc", "r", "c"):
            outs = [(t, n) for t, n in self.program.updates if self.doms[t] == dom]
            if outs:
                body += self._over(dom, [n for _, n in outs],
                                   [self._store(t, self.r.operand(self.lin, n), "j")
                                    for t, n in outs],
                                   f"write {', '.join(t for t, _ in outs)}: "
                                   f"{DOMAIN_WORDS[dom]}")
        return body

    def _entries(self) -> list[str]:
        body = self._start()
        for m in self.mats:
            n = f"n_{_TAG[m.dom]}"
            body.append(f"CT *{self._buf(m)} = (CT *)malloc(sizeof(CT) * (size_t)({n} > 0 ? "
                        f"{n} : 1));  /* {DOMAIN_WORDS[m.dom]} */")
        for k in range(self.axes.nstages + 1):
            body += self._stage(k)
        body += self._writes()
        body += [f"free({self._buf(m)});" for m in self.mats]
        return [AXES_HEADER,
                *self._pass_through(),
                "void vega_axes_step(int64_t nt, const int64_t *tab, const double *pre, "
                "int nth) {",
                *self._prologue("{ pass_through(nt, tab); return; }"),
                "    for (int64_t i = 0; i < nt; i++) {  /* one tensor at a time */",
                "        const int64_t *row = tab + i * ROW;",
                *("        " + line if line else "" for line in body),
                "    }",
                "}",
                "",
                *self._stage_entries()]

    def _stage_entries(self) -> list[str]:
        """The step over shards (``vega.codegen.c.launch.Kernel.staged``): an entry point
        per stage, ``vega_axes_stage<k>``, then ``vega_axes_write``, each over every tensor
        of the table. The materialized values live in the caller's buffers (``mtab``: per
        tensor, per materialized value, its ``m_`` buffer and its ``q_`` one, or 0), so they
        outlast a stage; the per-tensor reductions' results are read back from ``red``
        (``NRED_AXES`` slots a tensor, in ``AxisPlan.reductions``' order), combined across
        processes and finished by the caller between stages, and the values they give are
        computed again in each later entry."""
        nm = len(self.mats)
        out = [f"#define NRED_AXES {max(1, len(self.red_slots))}",
               f"#define NMAT_AXES {max(1, 2 * nm)}", ""]
        done: list[Node] = []
        for k in range(self.axes.nstages + 1):
            body = self._start()
            for j, m in enumerate(self.mats):
                body.append(f"CT *{self._buf(m)} = (CT *)(intptr_t)mtab[i * NMAT_AXES + "
                            f"{2 * j}];  /* {DOMAIN_WORDS[m.dom]} */")
                if m.op in AXIS_REDUCTIONS:
                    body.append(f"double *q_{self._buf(m)[2:]} = (double *)(intptr_t)"
                                f"mtab[i * NMAT_AXES + {2 * j + 1}];")
            body += [f"const CT {self._var(n)} = (CT)red[i * NRED_AXES + "
                     f"{self.red_slots[id(n)]}];" for n in done]
            body += self._known(1, k)
            body += self._stage(k, raw=True)
            last = k == self.axes.nstages
            if last:
                body += self._writes()
            else:
                done += self.axes.stage(k)[1]
            name = "vega_axes_write" if last else f"vega_axes_stage{k}"
            out += [f"void {name}(int64_t nt, const int64_t *tab, const double *pre, "
                    "double *red, const int64_t *mtab, int nth) {",
                    *self._prologue("{ pass_through(nt, tab); return; }" if last
                                    else "return;"),
                    "    for (int64_t i = 0; i < nt; i++) {",
                    "        const int64_t *row = tab + i * ROW;",
                    *("        " + line if line else "" for line in body),
                    "    }",
                    "}",
                    ""]
        return out
