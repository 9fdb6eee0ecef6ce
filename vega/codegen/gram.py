"""Newton-Schulz iterations on the Gram matrix: the reference kernel's second form of a
program whose matrix products iterate ``x <- (B(x xT) + s I) x`` (Muon's).

A spec writes the iteration on the matrix view (``vega.dsl``), rows x columns::

    repeat ns_steps {
        A = x @ transpose(x)
        x = a * x + (b * A + c * A @ A) @ x
    }

Each step multiplies ``x`` on the left by ``P = B(A) + a I``, a square matrix of the rows,
where ``B`` is any function of ``A = x xT`` alone. So after ``k`` steps ``x_k = R_k x_0``
with ``R_k = P_{k-1} ... P_0``, and the next Gram matrix follows from the last one without
``x``: ``A_{k+1} = P_k A_k P_kT``. Iterating on ``A`` and ``R`` (rows x rows) and multiplying
``x_0`` once at the end costs

    standard:  K (2 m^2 n + q m^3)
    Gram:      per run of L steps, 2 m^2 n + L q m^3 + 3 (L - 1) m^3

for an m x n matrix view, K steps and q square products in ``B`` (Muon's: 1). Where the
columns outnumber the rows by about 1.5 or more (a 768 x 3072 layer: 0.67 of the work) the
Gram form does less. The two are the same function of ``x_0``; in bfloat16 they round
differently, and the Gram form's rounding grows with the steps of a run (rounding gives
``A`` small negative eigenvalues, which the iteration then amplifies), so a run ends after
``RUN`` steps: ``x_3 = R_3 x_0`` computed, ``A`` and ``R`` begun again from it ("Gram
Newton-Schulz", Dao AI Lab, 2026, which restarts likewise). Measured against the float64
iteration (docs/performance.md), the restarted Gram form in bfloat16 is about as close as
the standard one, or closer.

Each product with ``P`` is taken as ``s M + B M`` (``Op.MATMUL_SHIFT``: ``s`` given as a
number is torch.addmm's exact ``beta``, not rounded into a bfloat16 ``P``'s diagonal):
``P A``, then ``P (P A)T = P A PT`` (``A`` symmetric), and ``R`` after the first ``P``,
which alone is formed (``Op.SHIFT``).

``gram_form`` finds such chains in a program (after ``reference.fuse_products``) and
returns the program with each written in the Gram form; the reference kernel runs it for
the tensors whose shape ``Gram.pays`` for.
"""
from __future__ import annotations

from dataclasses import dataclass

from vega.dsl.ir import Kind, Node, Op, Program, const, replaced, walk, with_updates

RUN = 3  # the most steps a run takes before the Gram form restarts from x
_SQUARE = (Op.MATMUL, Op.MATMUL_ADD, Op.MATMUL_SHIFT)  # products of two squares in ``B``


@dataclass(frozen=True)
class _Step:
    """One step ``y = (B(A) + s I) x`` (``s`` None: ``y = B(A) x``), ``A = x xT``."""
    y: Node
    x: Node
    s: Node | None
    b: Node
    a: Node
    squares: int  # the products of two rows x rows matrices that ``B`` computes from ``A``


@dataclass(frozen=True)
class Gram:
    """A program with its Newton-Schulz chains in the Gram form, and what decides where it
    pays: each chain's (steps, square products a step, its runs' lengths)."""
    program: Program
    chains: tuple[tuple[int, int, tuple[int, ...]], ...]

    def pays(self, rows: int, cols: int) -> bool:
        """Whether the Gram form does fewer multiply-adds for a matrix view of ``rows`` x
        ``cols`` (a batch of them alike) than the iteration as written. Never for one row:
        its Gram matrix is one number, whose product over the steps rounds as a whole; in
        bfloat16 the steps as written came out closer (a 1 x 256 matrix, 20 draws: median
        0.006 from the float64 iteration, against 0.038; from 2 rows on, alike)."""
        m, n = rows, cols
        if m < 2:
            return False
        standard = gram = 0
        for steps, q, runs in self.chains:
            standard += steps * (2 * m * m * n + q * m ** 3)
            gram += sum(2 * m * m * n + (length * q + 3 * (length - 1)) * m ** 3
                        for length in runs)
        return gram < standard


def _runs(steps: int) -> tuple[int, ...]:
    """The lengths of a chain's runs: ``RUN`` steps each, the rest last (5: 3 then 2)."""
    return (RUN,) * (steps // RUN) + ((steps % RUN,) if steps % RUN else ())


def _node(op: Op, *src: Node, dom: str, name: str | None = None, span=None) -> Node:
    return Node(op, src, None, "float", Kind.ELEMENT, span, name, dom)


def _gram_of(x: Node, span=None) -> Node:
    """``x @ transpose(x)`` of a rows x columns value."""
    return _node(Op.MATMUL, x, _node(Op.TRANSPOSE, x, dom="cr", span=span), dom="rr",
                 name="A", span=span)


def _step(y: Node, users: dict[int, int]) -> _Step | None:
    """``y`` as a step of the iteration, or None."""
    if y.kind != Kind.ELEMENT or y.dom != "rc":
        return None
    if y.op is Op.MATMUL_SHIFT:
        s, b, x = y.src
    elif y.op is Op.MATMUL:
        s, (b, x) = None, y.src
    else:
        return None
    if b.kind != Kind.ELEMENT or b.dom != "rr" or x.kind != Kind.ELEMENT or x.dom != "rc":
        return None
    # ``B``'s element values, down to the one Gram matrix ``x xT`` they all come from
    found: list[Node] = []
    inner: dict[int, Node] = {}
    todo = [b]
    while todo:
        n = todo.pop()
        if id(n) in inner or n.kind != Kind.ELEMENT:
            continue
        if n.op is Op.MATMUL and n.src[0] is x and n.src[1].op is Op.TRANSPOSE \
                and n.src[1].src[0] is x:
            if not any(f is n for f in found):
                found.append(n)
            continue
        if not n.src or n is x:  # (a parameter, gradient or state; or x itself)
            return None
        inner[id(n)] = n
        todo.extend(n.src)
    if len(found) != 1:
        return None
    if any(n.op is Op.WIDEN for n in inner.values()):
        # B widened may be of a wider dtype than x (bfloat16): the step's product, the next
        # x, and its Gram matrix are then of B's, where the Gram form would carry A's
        # rounding to x's dtype into every later step (a B rounded to bfloat16 meets a
        # wider x in x's dtype: x's stays)
        return None
    a = found[0]
    # nothing else reads ``A`` or the values between it and ``B`` (they are not computed in
    # the Gram form), nor ``x``'s transpose
    reads: dict[int, int] = {}
    for n in inner.values():
        for src in n.src:
            reads[id(src)] = reads.get(id(src), 0) + 1
    for n in (*inner.values(), a):
        if n is not b and users.get(id(n)) != reads.get(id(n)):
            return None
    if users.get(id(b)) != 1 or users.get(id(a.src[1])) != 1:
        return None
    squares = sum(n.op in _SQUARE for n in inner.values())
    return _Step(y, x, s, b, a, squares)


def _rewritten(chain: list[_Step]) -> Node:
    """The last value of ``chain`` computed in the Gram form."""
    x = chain[0].x
    done = 0
    for length in _runs(len(chain)):
        run = chain[done:done + length]
        span = run[0].y.span
        a = run[0].a if done == 0 else _gram_of(x, span)
        r = None
        for j, st in enumerate(run):
            b = replaced(st.b, {id(st.a): a}, {})
            if length == 1:  # (a run of one step: the step as written)
                x = _node(st.y.op, *((st.s,) if st.s is not None else ()), b, x, dom="rc",
                          name=st.y.name, span=st.y.span)
                break
            # P in the step's product's dtype (``x``'s and ``B``'s promoted), as the step
            # computes ``B + s I`` (or widens ``B``) before multiplying ``x``
            p = Node(Op.SHIFT, (const(0.0) if st.s is None else st.s, b, x), None, "float",
                     Kind.ELEMENT, st.y.span, "P", "rr")
            if st.s is None:  # P = B: the next Gram matrix P A PT, and R
                if j < length - 1:
                    a = _node(Op.MATMUL, _node(Op.MATMUL, p, a, dom="rr", span=span),
                              _node(Op.TRANSPOSE, p, dom="rr", span=span), dom="rr",
                              name="A", span=span)
                r = p if r is None else _node(Op.MATMUL, p, r, dom="rr", name="R", span=span)
                continue
            # P = B + s I multiplied as s M + B M (``reference._matmul_shift``: s exact where
            # it is a number, as the steps as written take it, not rounded into P's diagonal):
            # P A, then P (P A)T = P A PT (A symmetric), the next Gram matrix; R = P R
            if j < length - 1:
                pa = _node(Op.MATMUL_SHIFT, st.s, b, a, dom="rr", span=span)
                a = _node(Op.MATMUL_SHIFT, st.s, b, _node(Op.TRANSPOSE, pa, dom="rr", span=span),
                          dom="rr", name="A", span=span)
            r = p if r is None else _node(Op.MATMUL_SHIFT, st.s, b, r, dom="rr", name="R",
                                          span=span)
        else:
            x = _node(Op.MATMUL, r, x, dom="rc", name=run[-1].y.name, span=run[-1].y.span)
        done += length
    return x


def gram_form(program: Program) -> Gram | None:
    """``program`` with each chain of at least two Newton-Schulz steps in the Gram form, or
    None where it has none."""
    if not program.has_matrices:
        return None
    roots = [node for _, node in program.updates]
    order = walk(roots)
    users: dict[int, int] = {}
    for node in order:
        for s in node.src:
            users[id(s)] = users.get(id(s), 0) + 1
    steps = {id(st.y): st for st in (_step(n, users) for n in order) if st is not None}
    # chains: a step whose ``x`` is another's ``y`` read by nothing else (its Gram matrix,
    # that matrix's transpose operand and this step: three reads) continues it
    after = {id(st.x): st for st in steps.values()
             if id(st.x) in steps and users.get(id(st.x)) == 3}
    firsts = [st for st in steps.values() if after.get(id(st.x)) is not st]
    chains = []
    for first in firsts:
        chain = [first]
        while id(chain[-1].y) in after:
            chain.append(after[id(chain[-1].y)])
        if len(chain) >= 2:
            chains.append(chain)
    if not chains:
        return None
    swaps = {id(chain[-1].y): _rewritten(chain) for chain in chains}
    memo: dict[int, Node] = {}
    out = with_updates(program, ((target, replaced(node, swaps, memo))
                                 for target, node in program.updates))
    shape = tuple((len(c), max(st.squares for st in c), _runs(len(c))) for c in chains)
    return Gram(out, shape)
