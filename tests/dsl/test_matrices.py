"""Matrices of the matrix view (``@``, ``transpose``), ``repeat``, ``size``, ``bfloat16`` and
``widen``, against the same operations written in torch, on every backend (the programs
run on the reference's torch operations everywhere)."""
import pytest
import torch

import vega

BACKENDS = ["reference", "c", "triton"]


def step(text, params, grads, backend="reference", **hypers):
    spec = vega.compile(text)
    new, state = spec.step(params, grads, spec.init(params, **hypers), backend=backend,
                           **hypers)
    return new, state


def as_matrices(x, row, col):
    """The matrix view written out: batch axes first, then the row axis, then the column."""
    order = [a for a in range(x.dim()) if a not in (row, col)] + [row, col]
    return x.permute(order)


@pytest.mark.parametrize("backend", BACKENDS)
def test_products_and_transposes_of_the_matrix_view(backend):
    """A wide, a tall and a batched tensor: their matrix views (rows the shorter side, the
    batch axis the smallest) multiplied as torch.matmul does, and written back."""
    text = """
    optimizer o() {
        A = g @ transpose(g)
        C = transpose(g) @ g
        p = p + A @ g + g @ C + transpose(transpose(g))
    }"""
    gen = torch.Generator().manual_seed(0)
    shapes = [((3, 5), 0, 1), ((5, 3), 1, 0), ((2, 3, 4), 1, 2), ((4, 2, 3), 2, 0)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _, _ in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _, _ in shapes]
    new, _ = step(text, params, grads, backend)
    for (shape, r, c), p, g, got in zip(shapes, params, grads, new):
        m = as_matrices(g, r, c)
        want = as_matrices(p, r, c) + (m @ m.mT) @ m + m @ (m.mT @ m) + m
        torch.testing.assert_close(as_matrices(got, r, c), want, rtol=1e-12, atol=1e-12)


def test_a_number_times_a_products_operand_is_added_on_the_diagonal():
    """``s * x + B @ x`` (B square, s one number: Newton-Schulz's ``a * x + ...``) is one
    product of ``B + s I`` and ``x``, with no pass over ``x``'s size for ``s * x``: the
    same values (float64), for a wide, a tall and a batched tensor, ``s`` a hyperparameter,
    a per-tensor value or a number, on either side of the product and of the ``*``."""
    text = """
    optimizer o(a = 1.5) {
        A = g @ transpose(g)
        B = transpose(g) @ g
        s = norm(g)
        y = a * g + A @ g
        z = B @ transpose(g) + transpose(g) * s
        w = (2 * A + A @ A) @ g
        p = p + y + transpose(z) + 0.5 * g + 3 * A @ g + w
    }"""
    # y, z and w's 2 * A + A @ A; not 0.5 * g nor 3 * A (no product of theirs added)
    assert vega.compile(text).source("reference", (3, 5)).count("_matmul_shift(") == 3
    gen = torch.Generator().manual_seed(1)
    shapes = [((3, 5), 0, 1), ((5, 3), 1, 0), ((2, 3, 4), 1, 2)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _, _ in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _, _ in shapes]
    new, _ = step(text, params, grads)
    for (shape, r, c), p, g, got in zip(shapes, params, grads, new):
        m = as_matrices(g, r, c)
        a_, b_ = m @ m.mT, m.mT @ m
        s_ = torch.linalg.vector_norm(g)
        y = 1.5 * m + a_ @ m
        z = b_ @ m.mT + m.mT * s_
        w = (2 * a_ + a_ @ a_) @ m
        want = as_matrices(p, r, c) + y + z.mT + 0.5 * m + 3 * a_ @ m + w
        torch.testing.assert_close(as_matrices(got, r, c), want, rtol=1e-12, atol=1e-12)


def test_a_number_added_on_a_bfloat16_diagonal_meets_a_wider_operand_in_its_type():
    """``a * g + A @ g`` with ``A`` bfloat16 and ``g`` float32: ``a`` is added on ``A``'s
    diagonal in float32, as ``a * g`` would be computed, not rounded to bfloat16."""
    text = """
    optimizer o(a = 3.4445) {
        x = bfloat16(g)
        A = x @ transpose(x)
        p = p + (a * g + A @ g)
    }"""
    assert vega.compile(text).source("reference", (16, 64)).count("_matmul_shift(") == 1
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(16, 64, generator=gen)
    new, _ = step(text, [torch.zeros(16, 64)], [g])
    x = g.to(torch.bfloat16)
    want = 3.4445 * g.double() + (x @ x.T).double() @ g.double()  # (A: a bfloat16 product)
    torch.testing.assert_close(new[0].double(), want, rtol=1e-5, atol=1e-5)


def test_a_vector_is_one_row_and_a_scalar_one_by_one():
    text = "optimizer o() {\n p = p + (g @ transpose(g)) @ g\n}"
    v, s = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor(2.0).double()
    new, _ = step(text, [torch.zeros(3).double(), torch.zeros(()).double()], [v, s])
    torch.testing.assert_close(new[0], 14.0 * v)
    torch.testing.assert_close(new[1], torch.tensor(8.0).double())


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeat_unrolls_by_a_number_and_by_a_hyperparameter(backend):
    by_number = "optimizer o() {\n repeat 3 {\n p = 2 * p + g\n }\n}"
    by_hyper = "optimizer o(n = 2.0 in [0, 6]) {\n repeat n {\n p = 2 * p + g\n }\n}"
    p, g = torch.ones(4, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    assert torch.equal(step(by_number, [p], [g], backend)[0][0], p * 8 + g * 7)
    for n in (0, 1, 2, 5):  # (each value picks its own program)
        want = p.clone()
        for _ in range(n):
            want = 2 * want + g
        got = step(by_hyper, [p], [g], backend, n=float(n))[0][0]
        assert torch.equal(got, want), n


def test_size_bfloat16_and_widen():
    text = """
    optimizer o() {
        x = bfloat16(g)
        p = p + size(p, 0) * widen(x) + 100 * size(p, 3) - widen(x * 3)
    }"""
    g = torch.tensor([[1.0 + 2 ** -12, 3.0]], dtype=torch.float32)  # (rounds in bfloat16)
    new, _ = step(text, [torch.zeros(1, 2)], [g])
    x = g.to(torch.bfloat16)
    want = 1 * x.float() + 100 * 1 - (x * 3).float()
    assert torch.equal(new[0], want)
    assert not torch.equal(x.float(), g)


def test_matrix_programs_run_on_the_reference_kernels():
    spec = vega.compile("optimizer o() {\n p = p - g @ transpose(g) @ g\n}")
    program = spec.program(shape=(3, 4))
    assert program.torch_only and program.has_matrices
    shown = spec.source("reference", shape=(3, 4))
    assert spec.source("c", shape=(3, 4)) == shown and "_tiled(" not in shown
    muon = vega.compile_file("specs/muon.vega")
    shown = muon.source("reference", shape=(3, 40))
    assert "_tiled(" in shown and "C loop" not in shown
    if vega.codegen.c.available():  # (the C backend's: its runs in C loops)
        assert muon.source("c", shape=(3, 40)).startswith(shown)
        assert "C loop" in muon.source("c", shape=(3, 40))


def test_modes_and_initial_values_may_use_matrices_rows_and_sizes():
    """A mode or a state's initial value that alone uses the matrix view gets its geometry."""
    text = """
    optimizer o() {
        state z = p
        state d: scalar = size(p, 0) + norm(p @ transpose(p))
        z = z + g
        p = p - g
        mode eval {
            p = p - row_mean(z) + z @ transpose(z) @ p * size(p, 0)
        }
        mode train {
            p = p
        }
    }"""
    spec = vega.compile(text)
    p = torch.randn(3, 4, dtype=torch.float64)
    state = spec.init([p])
    assert float(state["d"][0]) == pytest.approx(3 + float((p @ p.T).norm()), rel=1e-12)
    z = state["z"][0]
    got = spec.mode("eval", [p], state)[0]
    torch.testing.assert_close(got, p - z.mean(1, keepdim=True) + z @ z.T @ p * 3,
                               rtol=1e-12, atol=1e-12)


def test_bfloat16_matrices_meet_the_compute_type_by_promotion():
    """x + a @ b fused into one product, and @ itself, across bfloat16 and float32: torch's
    promotion, as the elementwise operations have it."""
    text = """
    optimizer o() {
        x = bfloat16(g)
        p = p - 0.01 * (widen(x) + x @ transpose(x) @ x) + 0.001 * ((g @ transpose(g)) @ x)
    }"""
    g = torch.randn(3, 5)
    new, _ = step(text, [torch.zeros(3, 5)], [g])
    x = g.to(torch.bfloat16)
    want = -0.01 * (x.float() + x @ x.T @ x) + 0.001 * ((g @ g.T) @ x.float())
    torch.testing.assert_close(new[0], want, rtol=2e-2, atol=1e-3)


def test_a_mode_takes_ifs_on_the_shape():
    spec = vega.compile("optimizer o() {\n p = p - g\n mode eval {\n if ndim(p) == 2 {\n"
                        " p = 2 * p\n } else {\n p = 3 * p\n }\n }\n mode train {\n p = p\n }\n}")
    params = [torch.ones(2, 2), torch.ones(3)]
    got = spec.mode("eval", params, spec.init(params))
    assert torch.equal(got[0], torch.full((2, 2), 2.0)) and torch.equal(got[1], torch.full((3,), 3.0))


def test_a_rule_with_one_mode_steps_functionally_but_makes_no_class():
    """spec.mode takes any mode the spec declares; the class, whose steps run in mode train
    and whose eval() and train() switch there and back, needs exactly those two (with eval
    alone, eval() left it unable to step again)."""
    spec = vega.compile("optimizer o(lr = 0.1) {\n p = p - lr * g\n mode eval {\n p = 2 * p\n"
                        " }\n}")
    assert torch.equal(spec.mode("eval", [torch.ones(2)], spec.init([torch.ones(2)]))[0],
                       torch.full((2,), 2.0))
    with pytest.raises(ValueError, match=r"^O: the rule's modes are 'eval'; the class steps in "
                                         r"mode 'train' and switches with train\(\) and "
                                         r"eval\(\), so its rule declares exactly"):
        spec.optimizer([torch.nn.Parameter(torch.ones(2))])


def test_bfloat16_products_step_side_by_side_only_for_tensors_with_values_in_memory():
    """Tensors of one shape take their bfloat16 products together (``_batches``), found
    again by their addresses: not a tensor without values (an empty one; a meta or lazy
    one, whose address is 0), which steps alone. A sum with a product of empty matrices
    steps as one product of each would."""
    from vega.codegen import reference
    spec = vega.compile("optimizer o() {\n x = bfloat16(g)\n"
                        " p = p + widen(x + x @ transpose(x) @ x)\n}")
    empty = [torch.zeros(0, 4), torch.zeros(0, 4)]
    new, _ = spec.step(empty, empty, spec.init(empty))
    assert [tuple(n.shape) for n in new] == [(0, 4), (0, 4)]
    kern = reference.Kernel(spec.program(shape=(2, 3)))
    ones, meta = torch.ones(2, 3), torch.ones(2, 3, device="meta")
    assert kern._batches([ones, ones, ones], [ones] * 3, []) == [[0, 1, 2]]
    assert kern._batches([meta, meta], [meta] * 2, []) == [[0], [1]]
    assert kern._batches(empty, empty, []) == [[0], [1]]
    for p, g, n in zip(*_stepped(spec, (2, 3), 3, 3)):
        x = g.to(torch.bfloat16)
        torch.testing.assert_close(n, p + (x + x @ x.T @ x).float(), rtol=1e-2, atol=1e-2)


def _stepped(spec, shape, count: int, seed: int):
    """Random parameters and gradients of ``shape``, and the parameters ``spec`` steps
    them to from its initial state."""
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(shape, generator=gen) for _ in range(count)]
    gs = [torch.randn(shape, generator=gen) for _ in range(count)]
    got, _ = spec.step(ps, gs, spec.init(ps))
    return ps, gs, got


def muon_steps_alike(monkeypatch, shapes, seed: int, name: str, runs, check) -> None:
    """Muon from random parameters of ``shapes``, 3 steps, in float32 (bfloat16 products)
    and float64, once for each ``(settings, fn)`` of ``runs``: the module's attributes
    ``settings`` set (``vega.codegen.reference``'s) and the kernels' helper ``name``
    replaced by ``fn`` (put back after, whatever happens). Every run's parameters and state
    bitwise equal; ``check(kernels)`` after each dtype's runs."""
    from vega import codegen
    from vega.codegen import reference
    spec = vega.compile_file("specs/muon.vega")
    gen = torch.Generator().manual_seed(seed)
    for dtype, bf16 in ((torch.float32, True), (torch.float64, False)):
        start = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
                 for _ in range(3)]
        kerns = [codegen.kernel("reference", spec.program(s, bf16=bf16)) for s in shapes]
        fns = [f for k in kerns for f in (k._update, k._update_batched,
                                          *((k._gram[1], k._gram[2]) if k._gram else ()))
               if f is not None]
        results = []
        try:  # (the kernels are kept with their programs: put back for later tests)
            for settings, fn in runs:
                for attr, value in settings.items():
                    monkeypatch.setattr(reference, attr, value)
                for f in fns:
                    f.__globals__[name] = fn
                ps = [p.clone() for p in start]
                state = spec.init(ps, bf16=bf16)
                for gs in grads:
                    ps, state = spec.step(ps, gs, state, backend="reference", bf16=bf16)
                results.append((ps, torch.utils._pytree.tree_leaves(state)))
        finally:
            for f in fns:
                f.__globals__[name] = getattr(reference, name)
        (ps_a, st_a), (ps_b, st_b) = results
        assert all(torch.equal(a, b) for a, b in zip(ps_a, ps_b))
        assert len(st_a) == len(st_b) > len(shapes)
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(st_a, st_b))
        check(kerns)


def test_arithmetic_of_a_matrix_program_writes_over_its_dead_temporaries(monkeypatch):
    """In a program with matrix products, ``+ - * /`` of a temporary that dies there writes
    its value over it (``reference._into``): Muon's steps, batched (bfloat16) and one tensor
    at a time (float64), give bitwise the values the same functions give with every such
    operation making a new tensor, parameters and momentum; and most such operations did
    write over (not where a tall matrix's transposed product meets the row-major
    parameter: the result keeps the layout a new tensor would take)."""
    from vega.codegen import reference
    overs = []

    def into(dead, how, a, b):
        out = reference._into(dead, how, a, b)
        overs.append(out is dead)
        return out

    def apart(dead, how, a, b):
        return reference._INTO[how][0](a, b)

    def check(kerns):
        assert all("_into(" in k.source() for k in kerns)
        assert sum(overs) > len(overs) / 2
        overs.clear()
    muon_steps_alike(monkeypatch, [(6, 9), (6, 9), (9, 6), (7, 5), (7, 5)], 8, "_into",
                     [({}, into), ({}, apart)], check)


def test_writing_over_a_temporary_falls_back_to_a_new_tensor_where_it_does_not_fit():
    """``_into`` writes over its temporary only where the result has its shape, dtype and
    device, the operands are plain tensors (or a number where the order allows), and no
    gradient is recorded; else it returns a new tensor and leaves the temporary as it was.
    Either way the values are the operation's, bitwise."""
    from vega.codegen.reference import _into
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)

    class Sub(torch.Tensor):
        pass

    def check(dead, how, x, y, over):
        before = dead.clone()
        want = {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[how]
        with torch.no_grad():
            got = _into(dead, how, x, y)
        assert torch.equal(got, want) and got.dtype == want.dtype
        assert (got is dead) == over
        if not over:
            assert torch.equal(dead, before)
    for how in "+-*/":
        check(a.clone(), how, a, b, True)
        check(a.clone(), how, a, 2.0, True)
        check(a[0].clone(), how, a, b, False)  # a row: the result is larger
        check(a.bfloat16(), how, a, b, False)  # bfloat16: the result is float32
        check(a.double(), how, a, b, False)
        check(a.clone().as_subclass(Sub), how, a, b, False)
        check(a.clone(), how, a.as_subclass(Sub), b, False)
    check(a.clone(), "+", 2.0, b, True)
    check(a.clone(), "*", 2.0, b, True)
    check(a.clone(), "-", 2.0, b, False)
    check(a.clone(), "/", 2.0, b, False)
    with torch.enable_grad():
        w = b.clone().requires_grad_()
        dead = a.clone()
        got = _into(dead, "*", a, w)
    assert got is not dead and got.requires_grad and torch.equal(dead, a)


def test_a_value_a_product_reads_is_not_written_over():
    """A temporary read by a product (its stacked copy found again by its address) or a
    transpose (a view of it) is not written over at its last use: the second product's
    batch stacks ``z``'s values, not the stale copy of ``y`` at the same address."""
    spec = vega.compile("optimizer o() {\n x = bfloat16(2 * g)\n A = x @ transpose(x)\n"
                        " z = x + 1\n p = p + widen(A @ z)\n}")
    assert "_into(" in spec.source(shape=(3, 4))
    for p, g, n in zip(*_stepped(spec, (3, 4), 3, 4)):
        x = (2 * g).to(torch.bfloat16)
        want = p + (x @ x.T @ (x + 1)).float()
        torch.testing.assert_close(n, want, rtol=0, atol=0)


def test_a_conversion_written_over_is_a_tensor_of_its_own():
    """``bfloat16`` of a value that is bfloat16 already is that value itself (torch's
    ``to``): where the conversion's value is written over later, it is made a tensor of
    its own, so the value it came from keeps its values."""
    spec = vega.compile("optimizer o() {\n x = bfloat16(g)\n y = bfloat16(x)\n"
                        " z = y * 2\n p = p + widen(z) + widen(x @ transpose(x)) @ g + widen(x)\n}")
    text = spec.source(shape=(3, 4))
    assert "_into(" in text and "_bf16(v_x, p, True)" in text
    for p, g, n in zip(*_stepped(spec, (3, 4), 2, 5)):
        x = g.to(torch.bfloat16)
        # (``a + b @ g``, the sum rounded once: reference._matmul_add's torch.addmm, whose
        # bits differ from a product then a sum on some CPUs' BLAS)
        want = torch.addmm(p + (x * 2).float(), (x @ x.T).float(), g) + x.float()
        torch.testing.assert_close(n, want, rtol=0, atol=0)


def test_a_value_written_over_keeps_the_layout_a_new_tensor_would_take(monkeypatch):
    """A sum over a value written over a temporary adds in the order of a new tensor's
    layout: on a tall matrix a product's result is laid out transposed, and ``h + k``
    written over ``k`` (row-major) would sum in another order. Bitwise the step with
    every operation making a new tensor."""
    from vega import codegen
    from vega.codegen import reference
    spec = vega.compile("optimizer o() {\n y = (g @ transpose(g)) @ g\n h = y * 2\n"
                        " k = g * 3\n z = h + k\n s = sum(z)\n p = p + s + h\n}")
    assert "_into(v_k, '+', v_h, v_k)" in spec.source(shape=(256, 64))
    gen = torch.Generator().manual_seed(0)
    p, g = (torch.randn(256, 64, generator=gen) for _ in range(2))
    got, _ = spec.step([p], [g], spec.init([p]))
    kern = codegen.kernel("reference", spec.program(shape=(256, 64)))
    monkeypatch.setitem(kern._update.__globals__, "_into",
                        lambda dead, how, a, b: reference._INTO[how][0](a, b))
    want, _ = spec.step([p], [g], spec.init([p]))
    assert torch.equal(got[0], want[0])


def test_runs_of_element_lines_are_computed_a_part_at_a_time(monkeypatch):
    """In a program with matrix products, a run of two or more element lines over the whole
    matrix view (Muon's momentum, ``u`` and its rounding; its update of the parameter) of a
    CPU tensor is computed ``reference.TILE`` values at a time (``_tiled``): bitwise the values
    of the whole tensors at once, parameters and momentum, in float64 and bfloat16, wide
    (the Gram form), square, tall (whose product comes out transposed: its run takes the
    whole tensors) and batched matrices, over 3 steps."""
    from vega.codegen import reference
    parts = []

    def tiled(fn, full, rest):
        return reference._tiled(lambda *a: parts.append(a[0].numel()) or fn(*a), full, rest)

    def check(kerns):
        assert all("_tiled(" in k.source() for k in kerns[:4])
        # parts of 64 values: 25 a run of a 1,600-value matrix; the whole tensors at once
        assert parts.count(64) >= 3 * 3 * 25 and 1600 in parts
        parts.clear()
    muon_steps_alike(monkeypatch, [(8, 200), (8, 200), (200, 8), (40, 40), (9,)], 11,
                     "_tiled", [({"TILE": 64}, tiled), ({"TILE": 1 << 30}, tiled)], check)
    monkeypatch.setattr(reference, "TILE", 64)
    calls = []
    for device in ("cpu", "meta"):  # (another device: the whole tensors at once)
        both = (torch.zeros(800, 4, device=device),) * 2
        with torch.no_grad():  # (as a step runs)
            got = reference._tiled(lambda a, b: calls.append(a.numel()) or (a + b,), both, ())
        assert got[0].shape == (800, 4) and got[0].device.type == device
    assert calls == [64] * 50 + [3200]


@pytest.mark.parametrize("backend", BACKENDS)
def test_widen_and_bfloat16_of_a_number_in_the_scalar_phase(backend):
    """``widen(2)`` and ``bfloat16(lr)`` are values of the scalar phase (of no tensor):
    there the number is made a tensor on ``t``'s device, and a number that stays one is
    given to the element phase in the compute type."""
    text = "optimizer o(lr = 0.1) {\n y = (g @ transpose(g)) @ g\n" \
           " p = p - widen(2) - bfloat16(lr) + 0 * y\n}"
    spec = vega.compile(text)
    p, g = torch.ones(2, 3), torch.full((2, 3), 0.5)
    new, _ = spec.step([p], [g], spec.init([p]), backend=backend)
    want = 1.0 - 2.0 - float(torch.tensor(0.1).bfloat16())
    assert torch.equal(new[0], torch.full((2, 3), want))


def _loops_and_reference(backend, spec, shapes, dtype, steps, seed, **hypers):
    """``spec`` stepped ``steps`` times from the same random parameters and gradients on
    ``backend`` and on the reference's: (each one's parameters and state leaves), and the
    loops the backend's step ran (``vega.codegen.runs.COUNTS``)."""
    from vega.codegen import runs
    name = LOOPS[backend]
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    out = []
    before = runs.COUNTS.get(name, 0)
    for b in (backend, "reference"):
        ps = [p.clone() for p in start]
        state = spec.init(ps, **hypers)
        for gs in grads:
            ps, state = spec.step(ps, gs, state, backend=b, **hypers)
        out.append((ps, torch.utils._pytree.tree_leaves(state)))
        if b == backend:
            loops = runs.COUNTS.get(name, 0) - before
    return out, loops


# the backends whose loops compute element runs (``vega.codegen.runs``): their class's name
LOOPS = {"c": "CRuns", "triton": "TritonRuns"}
LOOP_BACKENDS = [
    pytest.param("c", marks=pytest.mark.skipif(not vega.codegen.c.available(),
                                               reason="no C compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(
        "triton" not in vega.codegen.BACKENDS, reason="triton is not installed"))]


def _same_bits(a, b) -> bool:
    """Whether ``a`` and ``b`` hold the same values bit for bit (signed zeros told apart),
    NaN where the other has NaN (of any payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a.contiguous().view(ints)[~nan], b.contiguous().view(ints)[~nan])


def _alike(results) -> None:
    (ps_a, st_a), (ps_b, st_b) = results
    assert all(_same_bits(a, b) for a, b in zip(ps_a, ps_b))
    assert len(st_a) == len(st_b)
    assert all(a is b is None or _same_bits(a, b) for a, b in zip(st_a, st_b))


def _device(backend):
    """Where ``backend``'s loops run: Triton's on the GPU, or on the CPU under its
    interpreter."""
    from vega.codegen import triton_runtime
    return "cuda" if backend == "triton" and not triton_runtime.interpreting() else "cpu"


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
@pytest.mark.parametrize("dtype, bf16", [(torch.float32, True), (torch.float32, False),
                                         (torch.bfloat16, True), (torch.float64, True),
                                         (torch.float64, False)])
def test_muons_element_runs_are_loops_of_the_backend(backend, dtype, bf16):
    """On the C and Triton backends, Muon's runs of element lines (its momentum, Nesterov
    mix and rounding to bfloat16; its update of the parameter) are each one loop of the
    backend (``vega.codegen.runs``: a C loop, a Triton kernel): bitwise the reference's
    values, parameters and momentum, for wide (the Gram form), tall, square and one-row
    matrices, two of one shape (stepped side by side, ``render_batched``), over 3 steps.
    The update of the tall matrix reads its products transposed (not contiguous): a
    contiguous copy of them first. Where a loop does not apply, the run stays on torch's
    operations: in float64, the rounding to bfloat16 (from float64 torch rounds twice)."""
    spec = vega.compile_file("specs/muon.vega")
    shapes = [(8, 200), (8, 200), (200, 8), (40, 40), (1, 90)]
    with torch.device(_device(backend)):
        results, loops = _loops_and_reference(backend, spec, shapes, dtype, 3, 5, bf16=bf16)
    _alike(results)
    before = 0 if dtype == torch.float64 and bf16 else len(shapes)
    assert loops == 3 * (before + len(shapes))


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_a_run_over_transposed_products_is_a_loop_only_where_nothing_sums_its_values(backend):
    """A tall matrix's products come out transposed. A run that reads one is a loop over a
    contiguous copy of it where the run's values are only returned (``p``'s update); where a
    later line reads them (``z``, whose norm sums it in its layout) the run stays on torch's
    operations, which keep that layout. Bitwise the reference's, over 2 steps."""
    text = """
    optimizer o(lr = 0.1) {
        state m = zeros
        m = 0.9 * m + g
        x = bfloat16(m)
        A = x @ transpose(x)
        z = widen(A @ x) * 2 + m
        n = norm(z)
        p = p - lr * (z / n) * 0.5
    }"""
    spec = vega.compile(text)
    for shape, runs in (((200, 8), 2), ((8, 200), 3)):  # (tall, wide)
        with torch.device(_device(backend)):
            results, loops = _loops_and_reference(backend, spec, [shape], torch.float32, 2, 6)
        _alike(results)
        assert loops == 2 * runs, shape


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_loops_compute_comparisons_selections_and_signs_as_the_reference(backend):
    """A run with every operation the loops take (``+ - * /``, comparisons, ``and``, ``or``,
    ``not``, ``where`` of numbers and of bools, ``min``, ``max`` (NaN winning), ``abs``,
    ``sign`` (of -0.0 and NaN), negation, numbers (-0.0 among them), ``bfloat16`` and
    ``widen`` (of subnormals too)): bitwise the reference's, NaN and signed zeros in the
    gradients and a NaN in the state included;
    and one with a square root, which stays on torch's operations (torch's float32 root on
    the CPU is not correctly rounded). Triton's divide by a value (a division by a number
    stays on torch's operations there: CUDA's torch multiplies by its reciprocal)."""
    text = """
    optimizer o(lr = 0.1) {
        state m = zeros
        state q = zeros
        state z = zeros
        state w = zeros
        state y = zeros
        m = 0.5 * m + g / DIVISOR
        w = -g
        y = g / where(g > 0, -0.0, 1.0) + widen(bfloat16(g * 1e-39)) * 1e38
        big = (m > 0.25 and not (g < -1)) or m != m
        q = where(big, min(m, 1), -abs(m)) + max(m, g) - max(2, g) + where(m > g, 1, 0)
        z = sign(g) * where(big, 2, 3) - min(g, 0)
        x = bfloat16(where(big, q, -q))
        A = x @ transpose(x)
        p = p - lr * widen(A @ x) - lr * z + ROOT
    }"""
    text = text.replace("DIVISOR", "3" if backend == "c" else "(abs(m) + 3)")
    device = _device(backend)
    gen = torch.Generator().manual_seed(3)
    for root, runs_each in (("0", 2), ("sqrt(abs(m))", 1)):
        spec = vega.compile(text.replace("ROOT", root))
        shapes = [(6, 30), (12, 12)]
        with torch.device(device):
            results, loops = _loops_and_reference(backend, spec, shapes, torch.float32, 2, 7)
        _alike(results)
        assert loops == runs_each * len(shapes) * 2
    g = torch.randn(6, 30, generator=gen)
    g[0, :4] = torch.tensor([float("nan"), -0.0, 0.0, float("inf")])
    p = torch.randn(6, 30, generator=gen)
    p, g = p.to(device), g.to(device)
    spec = vega.compile(text.replace("ROOT", "0"))
    outs = []
    for b in (backend, "reference"):  # (the NaN kept in m, beside a finite gradient)
        ps, state = spec.step([p], [g], spec.init([p]), backend=b)
        outs.append(spec.step(ps, [g.nan_to_num()], state, backend=b))
    _alike([(ps, torch.utils._pytree.tree_leaves(state)) for ps, state in outs])
    assert outs[0][1]["q"][0].isnan().sum() == 1
    assert (outs[0][1]["y"][0] == float("-inf")).any()  # (g over -0.0)


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_loops_compute_selections_of_bools_and_bool_numbers_as_the_reference(backend):
    """A ``where`` whose value is a bool (of two bools, of a bool and ``true`` or ``false``)
    is a loop's step of its own (the loop's bool form, and ``true`` and ``false`` written
    as the backend's numbers): bitwise the reference's, for float32, half and bfloat16
    parameters (their runs computed in float32), over 2 steps, in loops."""
    text = """
    optimizer o(lr = 0.1) {
        state m = zeros
        state k = zeros
        m = 0.5 * m + g
        c = where(g > 0, true, m < -1)
        d = where(m > 0.25, c, false)
        k = where(c and d, 1, 0) + where(c, m, -m) + where(where(d, c, m != m), 2, 0)
        x = bfloat16(k)
        A = x @ transpose(x)
        p = p - lr * widen(A @ x)
    }"""
    spec = vega.compile(text)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        with torch.device(_device(backend)):
            results, loops = _loops_and_reference(backend, spec, [(6, 30)], dtype, 2, 8)
        _alike(results)
        assert loops == 2 * 2, dtype


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_loops_leave_to_torch_what_torch_rounds_otherwise_and_allocate_on_its_device(backend):
    """A number over a value (``3.0 / x``: Python's ``/`` gives ``x.reciprocal() * 3.0``,
    rounded twice) stays on torch's operations, bitwise the reference's, and so does a
    value over a number on Triton (``vega.codegen.triton_runs``); a hyperparameter the
    products shift by, given as a number, keeps the 0-d tensor's values where it also
    divides; and a loop's results are on its tensors' device whatever torch's default
    device is."""
    text = """
    optimizer o(lr = 0.01, a = 3.4445) {
        state m = zeros
        state y = zeros
        state q = zeros
        m = 0.9 * m + g
        y = 3.0 / (m + 2.0)
        q = a / (m * m + 1.0)
        x = bfloat16(m)
        A = x @ transpose(x)
        x = a * x + A @ x
        p = p - lr * widen(x)
    }"""
    device = _device(backend)
    spec = vega.compile(text)
    with torch.device(device):
        results, loops = _loops_and_reference(backend, spec, [(8, 32), (16, 16)],
                                              torch.float32, 2, 4)
    _alike(results)
    assert loops == 2 * 2  # (the update: a loop; the run with the divisions: torch's)
    over = vega.compile(text.replace("y = 3.0 / (m + 2.0)", "y = m / 3.0").replace(
        "q = a / (m * m + 1.0)", "q = m + 1.0"))
    with torch.device(device):
        results, loops = _loops_and_reference(backend, over, [(8, 32)], torch.float32, 2, 4)
    _alike(results)
    assert loops == 2 * (2 if backend == "c" else 1)
    gen = torch.Generator().manual_seed(4)
    p, g = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
    p, g = p.to(device), g.to(device)
    m = 0.9 * torch.zeros(8, 32, device=device) + g
    for a in (3.4445, torch.tensor(3.4445, device=device)):
        _, state = spec.step([p], [g], spec.init([p]), backend=backend, a=a)
        want = torch.tensor(3.4445, device=device) / (m * m + 1.0)
        assert torch.equal(state["q"][0], want)
    muon = vega.compile_file("specs/muon.vega")
    want, _ = muon.step([p], [g], muon.init([p]), backend="reference")
    with torch.device("meta"):
        got, _ = muon.step([p], [g], muon.init([p]), backend=backend)
    assert got[0].device == p.device and _same_bits(got[0], want[0])
    # a number given for a hyperparameter that a run reads (as a number: the products shift
    # by it too), whatever the default device
    shifted = vega.compile(text.replace("y = 3.0 / (m + 2.0)", "y = a * m + 1.0").replace(
        "q = a / (m * m + 1.0)", "q = m - 1.0"))
    want = shifted.step([p], [g], shifted.init([p]), backend="reference", a=3.4445)
    from vega.codegen import runs
    before = runs.COUNTS.get(LOOPS[backend], 0)
    with torch.device("meta"):
        got = shifted.step([p], [g], shifted.init([p]), backend=backend, a=3.4445)
    assert runs.COUNTS.get(LOOPS[backend], 0) - before == 2
    _alike([(got[0], torch.utils._pytree.tree_leaves(got[1])),
            (want[0], torch.utils._pytree.tree_leaves(want[1]))])
