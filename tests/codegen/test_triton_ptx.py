"""The Triton kernels as a GPU runs them: compiled offline for sm_90a by Triton's own tool chain
(``vega.codegen.triton_ptx``), their PTX and ``ptxas -v`` read. No GPU is needed; only
Triton's wheel (its ``ptxas``).

A representative set, compiled once for the module (one subprocess, about 35 kernels):
AdamW's update in float32 and bfloat16 and with 8-bit state, the prelude and its finish, the
scalars kernel, LAMB's phase and finish, Adafactor's staged kernels and the standalone counter
advance, the bfloat16 updates with 8-bit state of AdamW, AdEMAMix and Adan, AdEMAMix's
float64 update, and Adafactor's staged kernels without int32 index arithmetic (as for tensors
of 2**31 elements); and every shipped spec's bfloat16 update (another subprocess).
``bench/ptx.py`` compiles every shipped spec's kernels.
"""
import dataclasses

import pytest
import torch

import vega
from vega.codegen import triton_ptx, triton_runtime

pytestmark = pytest.mark.skipif(triton_ptx.ptxas() is None,
                                reason="triton (with its ptxas) is not installed")

DEVICE = "cpu" if triton_runtime.interpreting() else "cuda"
FACTORED = ((257, 160),)  # adafactor factors it: its staged kernels


def _pick(launches, *suffixes):
    return [x for x in launches if x.kernel.endswith(suffixes)]


def _without_i32(launch):
    """``launch`` with its int32 index arithmetic off (``I32``), as for large tensors."""
    return dataclasses.replace(launch, constexprs=tuple(
        (k, False if k == "I32" else v) for k, v in launch.constexprs))


@pytest.fixture(scope="module")
def compiled():
    """(spec, dtype, kernel name) -> Figures, for the representative set."""
    sets = [
        ("adamw", "float32", triton_ptx.spec_launches("adamw", "float32", fused=True)),
        ("adamw", "bfloat16", _pick(triton_ptx.spec_launches("adamw", "bfloat16", fused=True),
                                    "_update")),
        ("lamb", "float32", _pick(triton_ptx.spec_launches("lamb", "float32", fused=True),
                                  "_phase0", "_finish0")),
        ("adafactor", "float32", _pick(triton_ptx.spec_launches(
            "adafactor", "float32", shapes=FACTORED), "_rc", "_r", "_c", "_m", "_advance")),
        # 8-bit state: the update of the tensor large enough for it (the last update launch)
        ("adamw", "uint8", _pick(triton_ptx.spec_launches(
            "adamw", "float32", fused=True, state_dtype=torch.uint8), "_update")[-1:]),
        # and over bfloat16 parameters, with clip+skip: the widest of the shipped specs
        *((name, "bfloat16,uint8", _pick(triton_ptx.spec_launches(
            name, "bfloat16", fused=True, state_dtype=torch.uint8), "_update")[-1:])
          for name in ("adamw", "ademamix", "adan")),
        # float64 parameters, left uncapped (a value takes two registers): under the cap of
        # 64, AdEMAMix's spilled 48 bytes
        ("ademamix", "float64", _pick(triton_ptx.spec_launches(
            "ademamix", "float64", fused=True), "_update")[-1:]),
        # Adafactor's staged kernels as the host launches them where an index or size may
        # pass int32 (I32 False: a tensor of 2**31 - BLOCK elements or more)
        ("adafactor", "float32,int64", [_without_i32(x) for x in _pick(triton_ptx.spec_launches(
            "adafactor", "float32", shapes=FACTORED), "_rc", "_r", "_c", "_m")
            if "I32" in dict(x.constexprs)]),
    ]
    launches = [x for _, _, found in sets for x in found]
    figures = triton_ptx.compile_launches(launches)
    by_key = {x.key(): f for x, f in zip(triton_ptx.distinct(launches), figures)}
    return {(spec, dtype, x.kernel): by_key[x.key()] for spec, dtype, found in sets
            for x in found}


def test_the_set_is_what_it_says(compiled):
    kinds = {name.removeprefix(f"vega_{spec}_") for spec, _, name in compiled}
    assert {"prelude", "scalars", "update", "phase0", "finish0", "stage0_r",
            "stage0_c", "stage1_m", "write_rc", "write_r", "write_c", "advance"} <= kinds


def test_addresses_reach_past_2_31_elements(compiled):
    """A tensor may hold 2**31 elements or more, and a step's tensors together far more. In
    Triton's IR: the update and phase kernels advance each tensor's address by its block's
    first element in int64 (AdamW's seven, read and written, besides the table's row and
    the scalars' row; LAMB's phase its parameter's and gradient's), then index within the
    block in int32; the prelude reads a gradient at int64 offsets; and Adafactor's staged
    kernels, which index in int32 where the host finds every index fits (I32), form every
    address from int64 offsets where it does not."""
    update = compiled["adamw", "float32", "vega_adamw_update"]
    assert update.i64_offsets == 9 and update.i32_offsets > 0, update
    phase = compiled["lamb", "float32", "vega_lamb_phase0"]
    assert phase.i64_offsets >= 4, phase
    prelude = compiled["adamw", "float32", "vega_adamw_prelude"]
    assert prelude.i64_offsets == 2, prelude  # (the table's row; the gradient's values)
    wide = {name: f for (spec, dtype, name), f in compiled.items() if dtype == "float32,int64"}
    assert len(wide) == 8, sorted(wide)
    for name, f in wide.items():
        assert f.i32_offsets == 0 and f.i64_offsets > 0, (name, f)
        assert compiled["adafactor", "float32", name].i32_offsets > 0, name  # (I32 on)


@pytest.mark.parametrize("dtype,loads,stores", [("float32", 4, 3), ("bfloat16", 4, 3)])
def test_update_kernels_use_128_bit_accesses(compiled, dtype, loads, stores):
    """AdamW's update on 16-byte aligned tensors: p, g, m and v each read, and p, m and v each
    written, with ld.global.v4 / st.global.v4 (a bfloat16 parameter: 8 values an access)."""
    f = compiled["adamw", dtype, "vega_adamw_update"]
    assert f.v4_loads >= loads and f.v4_stores >= stores, f


def test_update_kernels_fit_in_64_registers(compiled):
    """At the BLOCK and warps the runtime launches them with: 64 registers a thread let
    1,024 threads of an sm_90 SM's 2,048 run at once (65,536 registers an SM)."""
    updates = {k: f for k, f in compiled.items() if k[2].endswith("_update")
               and k[1] in ("float32", "bfloat16")}
    assert len(updates) == 2
    for key, f in updates.items():
        assert f.registers <= 64, (key, f)


def test_8bit_update_compiles_in_one_pass(compiled):
    """AdamW with 8-bit moments: one update kernel dequantizes, updates and requantizes (a
    block's largest magnitude by a reduction over its values, no libdevice, no double); p
    and g still read with 128-bit loads and p written with 128-bit stores."""
    f = compiled["adamw", "uint8", "vega_adamw_update"]
    assert f.libdevice == () and f.f64_ops == 0, f
    assert f.v4_loads >= 2 and f.v4_stores >= 1, f
    assert f.registers <= 64, f  # (71 uncapped, no spill under the cap)


def test_8bit_updates_of_bfloat16_parameters_fit_in_64_registers(compiled):
    """With 8-bit state, a bfloat16 parameter's update takes 4 values a thread (2 for adan's
    four states), not the 8 of a 128-bit access: at 8, AdamW used 121 registers and
    AdEMAMix 176, spilling 234 and 592 bytes under the cap of 64
    (``triton_runtime.update_block``)."""
    found = {spec: f for (spec, dtype, name), f in compiled.items()
             if dtype == "bfloat16,uint8"}
    assert sorted(found) == ["adamw", "adan", "ademamix"]
    for spec, f in found.items():
        assert f.registers <= 64 and f.spill_stores == f.spill_loads == 0, (spec, f)
        assert f.libdevice == () and f.f64_ops == 0, (spec, f)
    blocks = {spec: dict(x.constexprs)["BLOCK"] for spec, x in _eight_bit_launches().items()}
    assert blocks == {"adamw": 1024, "ademamix": 1024, "adan": 512}, blocks


def _eight_bit_launches() -> dict:
    return {name: _pick(triton_ptx.spec_launches(name, "bfloat16", fused=True,
                                                 state_dtype=torch.uint8), "_update")[-1]
            for name in ("adamw", "ademamix", "adan")}


@pytest.fixture(scope="module")
def every_update():
    """Spec name -> (its bfloat16 update Launch, Figures), for every shipped spec whose
    update Triton compiles (the others step on the reference there)."""
    found = {}
    for name in vega.builtin_names():
        ups = [x for x in triton_ptx.spec_launches(name, "bfloat16")
               if x.kernel.endswith("_update")]
        if ups:
            found[name] = ups[-1]
    launches = list(found.values())
    by_key = {x.key(): f for x, f in zip(triton_ptx.distinct(launches),
                                         triton_ptx.compile_launches(launches))}
    return {name: (x, by_key[x.key()]) for name, x in found.items()}


def test_every_update_fits_in_64_registers_without_spilling(every_update):
    """Every shipped spec's update over bfloat16 parameters (float32 state), at the runtime's
    BLOCK and warps and register cap (``triton_runtime.update_registers``): at most 64
    registers a thread, no spill, and still 128-bit accesses. Adan's and Prodigy's four
    states, and D-Adaptation's three with two numbers per tensor the update computes, take
    4 values a thread (``triton_runtime.update_block``): at 8, Adan needs 80 registers
    uncapped and spills 48 bytes under the cap, D-Adaptation 8; at 4, each float32 state
    is still read 128 bits at a time (the bfloat16 parameter and gradient 64)."""
    narrow = {"adan": 4, "prodigy": 4, "dadapt_adamw": 3}  # (their float32 states)
    assert len(every_update) >= 20, sorted(every_update)
    for name, (launch, f) in every_update.items():
        assert f.spill_stores == f.spill_loads == 0, (name, f)
        assert f.v4_loads >= narrow.get(name, 4) and f.v4_stores >= 3, (name, f)
        assert launch.maxnreg == 64 and f.registers <= 64, (name, f)
        block = dict(launch.constexprs)["BLOCK"]
        assert block == (1024 if name in narrow else 2048), (name, block)


def test_no_kernel_spills(compiled):
    for key, f in compiled.items():
        assert f.registers > 0 and f.spill_stores == f.spill_loads == 0, (key, f)
    assert ("ademamix", "float64", "vega_ademamix_update") in compiled


def test_elementwise_kernels_compute_no_per_step_scalar(compiled):
    """b1^t, b2^t and the clip coefficient are the scalars kernel's, once a step: no program
    of an update kernel calls libdevice or computes in double, nor does a phase kernel call
    libdevice (its per-block partial sums are float64, as the reference's)."""
    for key, f in compiled.items():
        if key[2].endswith(("_update", "_phase0")):
            assert f.libdevice == (), (key, f)
        if key[2].endswith("_update") and key[1] != "float64":  # (float64's own arithmetic)
            assert f.f64_ops == 0, (key, f)
    scalars = compiled["adamw", "float32", "vega_adamw_scalars"]
    assert "__nv_log2" in scalars.libdevice and scalars.f64_ops > 0  # (there, in double)


def test_clip_coefficient_max_keeps_nan(compiled):
    """max(norm, max_norm) in the clip coefficient is a propagating max: a NaN norm gives a
    NaN coefficient, as in the reference (PTX max alone returns max_norm)."""
    f = compiled["adamw", "float32", "vega_adamw_scalars"]
    assert f.max_nan >= 1 and f.max_dropping_nan == 0, f


def test_user_specs_beyond_the_shipped_ones_compile(tmp_path):
    """The kernels of the user specs of the Triton tests compile for sm_90a too: a per-tensor
    state set to a reduction, and every operation and reduction over float32, bfloat16 and
    float64 parameters, plain and with clip+skip. The interpreter does not type Triton's
    branches and the GPU's compiler does: there, a name bound before ``if finite:`` keeps its
    type inside it (a per-tensor value stored as a block is an expression, not a rebinding)."""
    from .test_c import REDUCED_STATE
    from .test_triton import EVERY_OP

    launches = []
    for text in (REDUCED_STATE, EVERY_OP):
        spec = vega.compile(text)
        params = {"f32": torch.randn(30, 40, device=DEVICE), "one": torch.randn(1, device=DEVICE),
                  "bf16": torch.randn(1000, device=DEVICE).to(torch.bfloat16),
                  "f64": torch.randn(7, device=DEVICE, dtype=torch.float64)}
        grads = {k: torch.randn_like(p) for k, p in params.items()}
        for more in ({}, dict(max_grad_norm=1.0, skip_nonfinite=True)):
            state = spec.init(params)
            launches += triton_ptx.record(lambda: spec.step(params, grads, state,
                                                            backend="triton", **more))
    kinds = {x.kernel.rsplit("_", 1)[-1] for x in launches}
    assert {"update", "phase0", "finish0", "scalars"} <= kinds, kinds
    figures = triton_ptx.compile_launches(launches)  # (raises where one does not compile)
    assert len(figures) == len(triton_ptx.distinct(launches))
    assert all(f.registers > 0 for f in figures), figures


EXP_LOG = """
optimizer o(lr = 0.1) {
    state m = zeros
    m = 0.5 * m + exp(g) - log(abs(g) + 1e-30) + expm1(g) * tanh(g)
    p = p - lr * m * sigmoid(g)
}"""


def _update_figures(spec) -> triton_ptx.Figures:
    """The compiled figures of ``spec``'s update kernel, stepping one float32 tensor."""
    params = {"w": torch.randn(3000, device=DEVICE)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = spec.init(params)
    launches = _pick(triton_ptx.record(lambda: spec.step(params, grads, state,
                                                         backend="triton")), "_update")
    (f,) = triton_ptx.compile_launches(launches)
    return f


def test_exp_and_log_of_float32_values_are_within_a_unit():
    """``exp``, ``log`` (and ``sigmoid``, ``expm1``, ``tanh``) of float32 element values are
    libdevice's float64 functions rounded to float32, within a unit in the last place as
    docs/language.md says: Triton's float32 ``tl.exp`` is ``ex2.approx.f32`` of
    ``x * log2(e)`` rounded to float32 on a GPU (64 units off near ``exp(87)``; the
    interpreter's numpy is exact to a unit) and its ``tl.log`` is libdevice's ``logf`` with
    subnormals flushed (``log(1e-40)`` gave ``-inf``). The update still fits in 64 registers
    without spilling."""
    f = _update_figures(vega.compile(EXP_LOG))
    # (expm1's float32 logf of u = e^x: where u is subnormal, u - 1 is -1, the log unused)
    assert f.fast_exp == 0 and {"__nv_exp", "__nv_log"} <= set(f.libdevice), f
    assert f.spill_stores == f.spill_loads == 0 and f.registers <= 64, f


@pytest.mark.parametrize("function,called", [
    ("erf(g)", "__nv_erff"), ("sin(g)", "__nv_sinf"), ("cos(g)", "__nv_cosf"),
    ("rsqrt(g * g + 1)", "__nv_rsqrtf"), ("log1p(abs(g))", "__nv_logf"),
    ("expm1(g)", "__nv_logf"), ("atan2(g, p)", "__nv_sqrtf")])
def test_a_rules_own_functions_call_libdevice(function, called):
    """docs/gpu.md: no libdevice call is left in an update kernel but a rule's own
    functions': besides exp, log and powers in float64, libdevice's float32 erf, sin and cos
    (whose argument reduction is in double), rsqrt, and the log and sqrt that log1p, expm1
    and atan2 are written with."""
    f = _update_figures(vega.compile("optimizer o(lr = 0.1) {\n    state m = zeros\n"
                                     f"    m = {function}\n    p = p - lr * m\n}}"))
    assert called in f.libdevice, f.libdevice
    assert (f.f64_ops > 0) == (function[:3] in ("sin", "cos", "exp")), f.f64_ops


# -- the host's alignment check, and the unaligned path (under the interpreter) --------------

def _aligned_flags(params):
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = vega.adamw_init(params)
    launches = triton_ptx.record(lambda: vega.adamw_step(params, grads, state, lr=1e-3,
                                                         backend="triton", donate=True))
    return [dict(x.constexprs)["ALIGNED"] for x in _pick(launches, "_update")]


def test_the_host_asks_for_128_bit_accesses_only_where_every_address_allows():
    buf = torch.randn(4097, device=DEVICE)
    assert _aligned_flags({"w": buf[:4096].clone(), "b": torch.randn(10, device=DEVICE)}) == \
        [True]
    assert _aligned_flags({"w": buf[1:], "b": torch.randn(10, device=DEVICE)}) == [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_unaligned_tensors_step_as_aligned_ones(dtype, fused):
    """Parameters that start 1 element into their storage (not 16-byte aligned) step through
    the path without alignment hints, full blocks and a partial one alike: bitwise the results
    of aligned copies, and the reference backend's within the dtype's tolerance."""
    n = triton_runtime.block_size() + 905  # a full block and a partial one
    torch.manual_seed(0)
    storage = torch.randn(n + 1, device=DEVICE).to(dtype)
    odd = {"w": storage[1:], "b": torch.randn(33, device=DEVICE).to(dtype)}
    even = {k: v.clone() for k, v in odd.items()}
    start = even["w"].clone()
    assert odd["w"].data_ptr() % 16 != 0 and even["w"].data_ptr() % 16 == 0
    grads = {k: torch.randn(v.shape, device=DEVICE).to(dtype) for k, v in odd.items()}
    more = dict(max_grad_norm=0.5, skip_nonfinite=True) if fused else {}
    ref = {k: v.clone() for k, v in odd.items()}
    out = []
    for params, backend in ((odd, "triton"), (even, "triton"), (ref, "reference")):
        state = vega.adamw_init(params)
        for _ in range(2):
            vega.adamw_step(params, grads, state, lr=0.1, backend=backend, donate=True,
                            **more)
        out.append((params, state))
    (p1, s1), (p2, s2), (p3, s3) = out
    for k in p1:
        assert torch.equal(p1[k], p2[k])
        assert torch.equal(s1["mu"][k], s2["mu"][k]) and torch.equal(s1["nu"][k], s2["nu"][k])
        torch.testing.assert_close(p1[k], p3[k])
        torch.testing.assert_close(s1["nu"][k], s3["nu"][k])
    assert not torch.equal(p1["w"], start)  # (it moved)


# -- the element runs of a program with matrix products (vega.codegen.triton_runs) -----------

RUN_OPS = """
optimizer o(lr = 0.1) {
    state m = zeros
    state z = zeros
    m = 0.5 * m + g / (abs(m) + 3)
    big = (m > 0.25 and not (g < -1)) or m != m
    z = sign(g) * where(big, min(m, 1), -abs(m)) - max(g, 0)
    x = bfloat16(where(big, m, -m))
    A = x @ transpose(x)
    p = p - lr * widen(A @ x) - lr * z
}"""


def test_element_runs_compile_to_exact_vector_kernels():
    """Muon's element runs and a run of every operation the loops take, compiled for sm_90a:
    torch's values need each product and sum rounded apart (no fused multiply-add), divisions
    rounded correctly (no ``div.full``), subnormals kept (no ``.ftz``); their loads and
    stores are 128 bits wide, and nothing spills."""
    launches = []
    for spec in (vega.compile_file("specs/muon.vega"), vega.compile(RUN_OPS)):
        params = [torch.randn(64, 256, device=DEVICE), torch.randn(96, 96, device=DEVICE)]
        grads = [torch.randn_like(p) for p in params]
        state = spec.init(params)
        launches += triton_ptx.record(lambda: spec.step(params, grads, state,
                                                        backend="triton"))
    runs = _pick(launches, "vega_run")
    assert len(runs) == 8 and all(not x.fp_fusion for x in runs), launches
    figures = triton_ptx.compile_launches(runs)
    assert len(figures) >= 3
    for f in figures:
        assert f.fmas == f.approximate == f.flushed == 0, f
        assert f.spill_stores == f.spill_loads == 0 and f.v4_loads >= 2 and f.v4_stores >= 1, f


def test_a_step_over_shards_compiles_its_raw_stage_kernels():
    """FSDP2's step of Adafactor's factored matrix over a shard splitting a reduced axis
    (``Kernel.staged``): its stage kernels leave a mean along an axis as its sum (``RAW``)
    and its finish kernels leave per-tensor sums raw; they compile for sm_90a without
    spills, as the plain step's do, with no more registers than theirs."""
    from vega import codegen
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import drive
    shape = FACTORED[0]
    program = vega.adafactor.program(shape)
    assert program.uses_axes
    kern = codegen.kernel("triton", program)
    full = geometry(shape)
    values = dict(lr=0.01, decay_rate=0.8, decay_offset=0.0, min_dim_size_to_factor=128.0,
                  clipping_threshold=1.0, momentum=0.9, weight_decay_rate=0.0, eps=1e-30,
                  param_scale_min=1e-3)
    assert set(values) == set(program.float_hypers)
    launches = {}
    for split in (None, 0, 1):  # the plain step's, and a shard of each axis
        n = shape[split] // 2 if split is not None else None
        p = torch.randn(shape, device=DEVICE) if split is None else \
            torch.randn(shape, device=DEVICE).narrow(split, 0, n).contiguous()
        local = Geometry(tuple(p.shape), axes=(full.r, full.c))
        view = ShardView(local, full, frozenset() if split is None else frozenset({split}))
        states = [s.narrow(local_axis, 0, n).contiguous()
                  if split is not None and (local_axis := _axis_of(full, s.dim(), split,
                                                                   st.dom)) is not None
                  else s for s, st in zip(kern.init(torch.randn(shape, device=DEVICE),
                                                    values, torch.float32), program.states)]
        steps = [torch.zeros((), dtype=torch.int32, device=DEVICE)]

        def step():
            drive({0: kern.staged([p], [torch.randn_like(p)], [[s] for s in states], steps,
                                  [values], False, None, [view])}, [None],
                  lambda parts: [x for _, x in parts])
        launches[split] = triton_ptx.record(step)
    raw = [x for k in (0, 1) for x in launches[k] if dict(x.constexprs).get("RAW")]
    plain = [x for x in launches[None] if "RAW" in dict(x.constexprs)]
    assert raw and plain
    assert {x.kernel for x in raw} >= {x.kernel for x in plain if "_stage" in x.kernel}
    figures = triton_ptx.compile_launches(raw + plain)
    by_key = {x.key(): f for x, f in zip(triton_ptx.distinct(raw + plain), figures)}
    most = {}
    for x in plain:
        most[x.kernel] = max(most.get(x.kernel, 0), by_key[x.key()].registers)
    for x in raw:
        f = by_key[x.key()]
        assert f.spill_stores == f.spill_loads == 0, (x.kernel, f)
        assert f.registers <= max(most.get(x.kernel, 64), 64), (x.kernel, f)


def _axis_of(full, ndim: int, axis: int, dom: str):
    """Where ``axis`` of a tensor of matrix view ``full`` sits in a value of domain ``dom``
    (of ``ndim`` axes), or None where that value has no such axis."""
    if not full.keeps(dom, axis) or ndim == 0:
        return None
    return full.position(axis, dom)


def test_a_spec_of_a_long_name_compiles():
    """A spec's name is as long as one likes, and its kernels' names, vega_<name>_update,
    longer: the offline compile wrote each kernel's PTX to a file of the kernel's name,
    which past 255 bytes the system refuses (OSError: File name too long)."""
    name = "o" * 250
    spec = vega.compile(f"optimizer {name}(lr = 0.1) {{\n  state m = zeros\n"
                        "  m = 0.9 * m + g\n  p = p - lr * m\n}\n")
    params = {"a": torch.randn(1000, device=DEVICE)}
    grads = {"a": torch.randn(1000, device=DEVICE)}
    state = spec.init(params)
    launches = triton_ptx.record(lambda: spec.step(params, grads, state, backend="triton",
                                                   donate=True))
    figures = triton_ptx.compile_launches(launches)
    assert [f.kernel for f in figures] == [x.kernel for x in triton_ptx.distinct(launches)]
    assert f"vega_{name}_update" in [f.kernel for f in figures]



def test_a_stochastically_rounded_bfloat16_update_fits_in_64_registers():
    """AdamW's bfloat16 update with stochastic rounding (uncapped: ``update_registers``)
    takes 62 registers a thread and spills nothing: an element's bits are one hash of the
    low 32 bits of its index (docs/precision.md). Taking the high 32 bits per element too
    (two hashes and an int64 index an element) took it to 110, half the threads an SM
    holds."""
    params = {"w": torch.randn(4096, dtype=torch.bfloat16, device=DEVICE)}
    grads = {"w": torch.randn_like(params["w"])}
    state = vega.adamw.init(params)
    launches = _pick(triton_ptx.record(lambda: vega.adamw.step(
        params, grads, state, backend="triton", donate=True, max_grad_norm=1.0,
        skip_nonfinite=True, stochastic_rounding=True, rounding_seed=3)), "_update")
    assert len(launches) == 1 and "to_bf16_sr(" in launches[0].source
    f, = triton_ptx.compile_launches(launches)
    assert f.registers <= 64 and f.spill_stores == 0, f
