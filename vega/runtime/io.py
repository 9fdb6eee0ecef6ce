"""Optimizer states on disk and leaf by leaf: ``save``, ``load``, ``get_leaf``, ``set_leaf``.

A state file is a safetensors file keyed by the state's leaf names
(``vega.state_names``: ``mu.layer1.weight``, ..., ``step``), with metadata that
marks it as a vega state. safetensors has no complex128, so a complex leaf is
stored as its real view (``torch.view_as_real``: the shape plus a trailing 2)
and the metadata lists it. A file is written to a temporary name in the target's
directory, flushed to disk and renamed into place: an interrupted save leaves
either the old file or none, never a truncated one. The metadata records each
leaf's CRC-32, which ``load`` checks: a file whose bytes changed on disk or on the
way is refused rather than loaded as other values (safetensors itself checks the
header and the sizes only). It records too the version of the maps that 8-bit codes are
read with (``quant.MAPS``), and ``load`` refuses codes written under other maps, or where
the file does not say: read with another map, they would be other values.

``load(path, like=state)`` checks the file against ``like`` -- the same names,
shapes and dtypes, the step counter int32 -- and returns a new state with
``like``'s structure, each tensor on the device of ``like``'s leaf.
"""
from __future__ import annotations

import difflib
import json
import numbers
import os
import secrets
import stat
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.utils import _pytree as pytree

from vega.codegen import quant
from vega.codegen.tensors import dense, is_dtensor, not_dense
from vega.runtime.tree import state_names

__all__ = ["get_leaf", "load", "save", "set_leaf"]

FORMAT = "vega.state"  # the value of the metadata key "vega"
FORMAT_VERSION = "1"


# -- naming the leaves ----------------------------------------------------------------

def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _named(state, who: str):
    """(name, index) of each non-None leaf, named as ``state_names`` names them; the
    full list of leaves (None included); the structure that rebuilds the state."""
    if not isinstance(state, dict):
        raise ValueError(f"{who}: a state is the dict of fields that <name>_init returns, "
                         f"got {type(state).__name__}")
    pairs, spec = pytree.tree_flatten_with_path(state, is_leaf=lambda x: x is None)
    named, leaves = [], []
    for path, leaf in pairs:
        leaves.append(leaf)
        keys = [_key(k) for k in path]
        if "" in keys:  # named by its path, the leaf would have no name or another's
            at = ".".join(keys[:keys.index("")])
            raise ValueError(f"{who}: the state has an empty key"
                             + (f" under {at!r}" if at else "") + "; each leaf is named by its "
                             "keys joined with '.', and an empty one leaves a name empty or "
                             "ambiguous: give it a name")
        if leaf is not None:
            named.append((".".join(keys), len(leaves) - 1))
    names = [n for n, _ in named]
    if names != state_names(state):  # the same rule, computed twice: an internal invariant
        raise AssertionError(f"leaf names disagree: {names} against {state_names(state)}")
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{who}: two leaves of the state are both named {name!r}; "
                             "rename a key so that each leaf has its own name")
        seen.add(name)
    return named, leaves, spec


def _suggest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    shown = ", ".join(map(repr, names[:8])) + (", ..." if len(names) > 8 else "")
    return f"; the state's leaves are {shown}"


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}"


# -- files ----------------------------------------------------------------------------

def _write(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write the safetensors file ``path`` (the temporary file of ``save``)."""
    save_file(tensors, path, metadata=metadata)


def save(path, state) -> None:
    """Write ``state`` to the safetensors file ``path``, keyed by its leaf names.

    The write is atomic: a temporary file in the same directory, flushed to disk
    (fsync), then renamed over ``path``.
    """
    if isinstance(path, dict) and isinstance(state, (str, os.PathLike)):
        # (torch.save's order, object first: the state would be refused as "a str")
        raise ValueError(f"vega.save: the path comes first, then the state: vega.save("
                         f"{os.fspath(state)!r}, state), where a dict and then a path were "
                         "given (torch.save's order)")
    named, leaves, _ = _named(state, "vega.save")
    tensors, complex_names, storages = {}, [], set()
    for name, i in named:
        leaf = leaves[i]
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(f"vega.save: state leaf {name!r} is a {type(leaf).__name__}, "
                             "not a tensor")
        if leaf.device.type == "meta":
            raise ValueError(f"vega.save: state leaf {name!r} is a meta tensor: it has a shape "
                             "but no values to save")
        _no_dtensor("vega.save: state", name, leaf)
        if leaf.layout != torch.strided:
            raise ValueError(f"vega.save: state leaf {name!r} is a {leaf.layout} tensor; a "
                             "state file holds dense tensors (save its .to_dense())")
        t = leaf.detach()
        if t.is_complex():
            complex_names.append(name)
            t = torch.view_as_real(t.resolve_conj())
        t = t.to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in storages or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses tensors that share memory
        storages.add(key)
        tensors[name] = t
    metadata = {"vega": FORMAT, "vega.version": FORMAT_VERSION,
                "vega.complex": json.dumps(complex_names), Q8_MAPS: str(quant.MAPS),
                CRC: json.dumps({name: _crc(t) for name, t in tensors.items()})}
    target = Path(os.fspath(path))
    directory = target.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"vega.save: cannot write {str(target)!r}: no directory "
                                f"{str(directory)!r}")
    if target.is_dir():  # (the rename over it failed naming the temporary file)
        raise IsADirectoryError(f"vega.save: {str(target)!r} is a directory; vega.save writes "
                                f"one file (a path such as {str(target / 'state.safetensors')!r})")
    tmp = str(directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies
    try:
        mode = (target if target.exists() else Path(tmp)).stat().st_mode & 0o7777
        _write(tmp, tensors, metadata)
        os.chmod(tmp, mode)  # safetensors writes its files private (0600)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # the rename itself survives a crash once the directory is flushed
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


CRC = "vega.crc32"  # the metadata key of each leaf's CRC-32, in a JSON object by leaf name


def _crc(t: torch.Tensor) -> int:
    """The CRC-32 of a CPU tensor's bytes (contiguous, as a file stores them)."""
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else 0


def _checksums(f, where: str) -> dict | None:
    """Each leaf's CRC-32 as the open file ``f`` records it; None in a file without them
    (written before they were)."""
    text = (f.metadata() or {}).get(CRC)
    if text is None:
        return None
    try:
        out = json.loads(text)
    except (ValueError, TypeError, RecursionError):  # (arrays nested past Python's stack)
        out = None
    if not isinstance(out, dict) or not all(type(v) is int for v in out.values()):
        raise ValueError(f"vega.load: {where} has corrupt {CRC!r} metadata (each leaf's "
                         "CRC-32, in a JSON object): load an intact copy of the file")
    return out


def _complex_names(f, where: str) -> set[str]:
    """Check that the open file ``f`` is a vega state; the names of its complex leaves."""
    metadata = f.metadata() or {}
    if metadata.get("vega") != FORMAT:
        raise ValueError(f"vega.load: {where} is a safetensors file but not a vega state (it "
                         "has no 'vega' metadata); write states with vega.save")
    if metadata.get("vega.version") != FORMAT_VERSION:
        raise ValueError(f"vega.load: {where} is a vega state of format version "
                         f"{metadata.get('vega.version')!r}; this vega reads version "
                         f"{FORMAT_VERSION!r}")
    try:
        names = json.loads(metadata.get("vega.complex", "[]"))
    except (ValueError, TypeError, RecursionError):  # (arrays nested past Python's stack)
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"vega.load: {where} has corrupt 'vega.complex' metadata (the names "
                         "of its complex leaves, in a JSON list): load an intact copy of the "
                         "file")
    return set(names)


def not_regular(mode: int) -> str | None:
    """What a file of ``os.stat`` mode ``mode`` is where it is not a regular file ("a FIFO",
    "a directory", ...), for a message that refuses it; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device"
            if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")


def load(path, *, like) -> dict:
    """The state saved in ``path``, with the structure of ``like``.

    Every leaf of ``like`` must be in the file with the same shape and dtype, and
    the file must have no other leaf; each tensor comes back on the device of
    ``like``'s leaf. Raises ``ValueError`` naming the leaf otherwise, and naming
    the file when it is not a vega state.
    """
    named, leaves, spec = _named(like, "vega.load")
    for name, i in named:
        if not isinstance(leaves[i], torch.Tensor):
            raise ValueError(f"vega.load: like= leaf {name!r} is a "
                             f"{type(leaves[i]).__name__}, not a tensor")
        _no_dtensor("vega.load: like=", name, leaves[i])
    where = repr(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"vega.load: no such file {where}")
    kind = not_regular(os.stat(path).st_mode)  # (a FIFO would block the read for ever)
    if kind is not None:
        raise ValueError(f"vega.load: {where} is {kind}, not a regular file; a state file is "
                         "one vega.save wrote")
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            out = pytree.tree_unflatten(_read(f, where, named, leaves), spec)
            maps = (f.metadata() or {}).get(Q8_MAPS)
    except (SafetensorError, OSError) as err:
        raise ValueError(f"vega.load: {where} is not a vega state file (not a readable "
                         f"safetensors file: {err})") from err
    _check_q8_maps(f"vega.load: {where}", maps, out)
    _check_scales(f"vega.load: {where}", out)
    _check_scale_kinds(f"vega.load: {where}", out)
    _check_q8_scales(f"vega.load: {where}", out)
    return out


Q8_MAPS = "vega.q8_maps"  # the metadata key of ``quant.MAPS`` as the file was written


def _q8_leaves(state, held, at: str = "") -> list[tuple[str, object]]:
    """(name, leaf) of each leaf of ``state``'s values under a key ``k`` of a dict that
    ``held(dict, k, value)`` accepts, at any depth of dicts, lists and tuples (a state
    saved inside the user's own tree): the walk of ``q8_codes`` and ``q8_scales``."""
    found = []
    if isinstance(state, dict):
        for k, v in state.items():
            name = f"{at}.{k}" if at else str(k)
            if isinstance(k, str) and held(state, k, v):
                found += [(".".join([name, *(_key(x) for x in path)]), leaf)
                          for path, leaf in pytree.tree_flatten_with_path(v)[0]]
            else:
                found += _q8_leaves(v, held, name)
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            found += _q8_leaves(v, held, f"{at}.{i}" if at else str(i))
    return found


def q8_codes(state) -> list[str]:
    """The names of the leaves of ``state`` that are 8-bit codes: uint8 tensors under a key
    ``k`` of a dict that also holds ``k + '_absmax'``, their scales."""
    return [name for name, leaf in _q8_leaves(state, lambda d, k, v: k + quant.SUFFIX in d)
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.uint8]


def _check_q8_maps(who: str, maps, state) -> None:
    """A file's 8-bit codes were written under this vega's maps (``quant.MAPS``, recorded
    as ``Q8_MAPS``): under others a state's codes may be read with another map than the
    one that formed them, as other values (AdamW's nu, read with the fourth-root map from
    codes of the square-root map, made steps hundreds of times too long)."""
    if maps == str(quant.MAPS):
        return
    codes = q8_codes(state)
    if not codes:
        return
    written = ("a vega that did not record which maps its 8-bit codes use" if maps is None
               else f"vega's 8-bit maps version {maps!r}")
    raise ValueError(f"{who} holds 8-bit codes (leaf {codes[0]!r}) written under {written}; "
                     f"this vega reads codes with maps version {quant.MAPS}, whose map for a "
                     "state may differ and read them as other values. Load the file with the "
                     "vega that wrote it and move the state to floats there (an optimizer of "
                     "float state, state_dtype=None, loading its state dict dequantizes it), "
                     "then load that here")


def _check_q8_scales(who: str, state) -> None:
    """The 8-bit scales of a state (``q8_scales``) hold no negative value
    (``quant.any_negative``), as ``load_state_dict`` checks them: a negative one gave NaN
    parameters at the next step."""
    for name, leaf in q8_scales(state):
        _no_negative_scale(f"{who}: leaf", name, leaf)


def q8_scales(state) -> list[tuple[str, object]]:
    """(name, leaf) of each leaf of ``state`` that is an 8-bit state's scales: under a key
    ``k + '_absmax'`` of a dict whose ``k`` holds their codes (``_scales_of``), a field of
    the state or of a state held deeper (``{"opt": state}``); a spec's own state of such a
    name (``state m_absmax``, a float state beside no codes) is none."""
    def held(d: dict, k: str, v) -> bool:
        base = k[:-len(quant.SUFFIX)]
        return k.endswith(quant.SUFFIX) and base in d and _scales_of(d[base], v)
    return _q8_leaves(state, held)


def _scales_of(codes, scales) -> bool:
    """Whether ``scales``, under ``k + '_absmax'`` beside ``codes`` under ``k`` in a state
    held deeper, are the 8-bit scales of ``codes``: each of its tensors where ``codes``
    holds uint8 codes, of the shape of their scales (``quant.scale_shape``: one value a
    block, or for a DTensor's, a row a shard), and not a parameter's own state under a
    name ending in ``_absmax`` (a 2-D one is no scales of a plain tensor's codes)."""
    held = dict(pytree.tree_flatten_with_path(codes)[0])
    found = False
    for path, leaf in pytree.tree_flatten_with_path(scales)[0]:
        if leaf is None:
            continue
        c = held.get(path)
        if not (isinstance(leaf, torch.Tensor) and isinstance(c, torch.Tensor)
                and c.dtype == torch.uint8 and leaf.is_floating_point()
                and tuple(leaf.shape) == quant.scale_shape(c)):
            return False
        found = True
    return found


def _no_dtensor(what: str, name: str, leaf) -> None:
    """ValueError for a DTensor leaf (a state sharded over ranks, FSDP2's): a state file
    holds one process's whole tensors, and a DTensor's storage is its rank's shard (saved,
    torch failed with "Attempted to access the data pointer on an invalid python storage";
    loaded, the leaf came back a plain tensor of the whole shape)."""
    if is_dtensor(leaf):
        raise ValueError(f"{what} leaf {name!r} is a DTensor, sharded over ranks; a state file "
                         "holds one process's whole tensors: save and load a sharded state "
                         "with torch.distributed.checkpoint (dcp.save and dcp.load, "
                         "docs/distributed.md)")


def _no_negative_scale(what: str, name: str, leaf) -> None:
    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and quant.any_negative(leaf):
        raise ValueError(f"{what} {name!r} holds a negative value; it is a state's 8-bit "
                         "scales, each its block's largest magnitude")


def _check_scale_kinds(who: str, state) -> None:
    """Each loss scale loaded is of the kind of ``like=``'s, static or dynamic: a file holds
    a scale's four tensors, ``like=`` its settings, and a static scale's good-step count is
    -1. A dynamic scale loaded as a static one would stop adjusting, and the reverse start
    to; neither is the scale saved."""
    found = _scale_kind_mismatch(state)
    if found is not None:
        name, count, saved, given = found
        raise ValueError(f"{who}: leaf {name!r} is {count}, the count of a {saved} loss "
                         f"scale, but like= has a {given} one there; give like= a "
                         f"LossScale.{saved}(...) to load it (its settings are like='s)")


def _scale_kind_mismatch(state):
    """(the leaf's name, its count, the kind that count is of, the scale's kind) for the
    first loss scale of ``state`` whose good-step count is of the other kind (-1 in a
    dynamic scale, another in a static one); None where there is none."""
    from vega.runtime.loss_scale import LossScale

    def is_scale(x):
        return isinstance(x, LossScale)

    for node in pytree.tree_leaves(state, is_leaf=is_scale):  # (named only where one is bad:
        if not is_scale(node) or node.good_steps.device.type == "meta":  # paths cost more)
            continue
        count = int(node.good_steps)
        if node.is_dynamic == (count == -1):
            saved, given = ("static", "dynamic") if count == -1 else ("dynamic", "static")
            path = next(p for p, x in pytree.tree_flatten_with_path(state, is_leaf=is_scale)[0]
                        if x is node)
            return ".".join([*(_key(k) for k in path), "good_steps"]), count, saved, given
    return None


def _check_scales(who: str, state) -> None:
    """Each loss scale in ``state`` holding values a scale can take (``check_scale_values``:
    a negative scale flips every update's sign, a NaN one skips every step)."""
    from vega.runtime.loss_scale import LossScale, check_scale_values
    for node in pytree.tree_leaves(state, is_leaf=lambda x: isinstance(x, LossScale)):
        if isinstance(node, LossScale):
            check_scale_values(who, node.tensors(), "the loss scale's ")


def _read(f, where, named, leaves) -> list:
    """``leaves`` with each named one replaced by its tensor in the open file ``f``."""
    complex_names = _complex_names(f, where)
    checksums = _checksums(f, where)
    keys = set(f.keys())
    names = [n for n, _ in named]
    missing = [n for n in names if n not in keys]
    if missing:
        raise ValueError(f"vega.load: {where} has no leaf {missing[0]!r}"
                         f"{_suggest(missing[0], sorted(keys))}"
                         + (f" ({len(missing)} leaves missing in all)" if len(missing) > 1
                            else "") + "; was it saved from a state of another optimizer, "
                         "other flags or other parameters?")
    extra = sorted(keys - set(names))
    if extra:
        raise ValueError(f"vega.load: {where} has leaf {extra[0]!r}, which the state given as "
                         f"like= does not have" + (f" ({len(extra)} such leaves)"
                                                   if len(extra) > 1 else ""))
    out = list(leaves)
    for name, i in named:
        want, got = leaves[i], f.get_tensor(name)
        if checksums is not None and checksums.get(name) != _crc(got):
            raise ValueError(f"vega.load: leaf {name!r} in {where} does not hold the bytes "
                             "vega.save wrote (their CRC-32, recorded in the file, differs): "
                             "the file is corrupt: load an intact copy of it")
        is_complex = name in complex_names
        if is_complex and (got.dim() == 0 or got.shape[-1] != 2 or not got.is_floating_point()):
            raise ValueError(f"vega.load: leaf {name!r} in {where} is marked complex but is "
                             f"{_describe(got)}")
        dtype = {torch.float32: torch.complex64, torch.float64: torch.complex128}.get(
            got.dtype, got.dtype) if is_complex else got.dtype
        shape = got.shape[:-1] if is_complex else got.shape
        if dtype != want.dtype:
            raise ValueError(f"vega.load: leaf {name!r} in {where} has dtype {dtype}, but the "
                             f"state given as like= has {want.dtype}")
        if shape != want.shape:
            raise ValueError(f"vega.load: leaf {name!r} in {where} has shape {tuple(shape)}, "
                             f"but the state given as like= has {tuple(want.shape)}")
        # A tensor that owns its memory: safetensors hands out views of the file's bytes,
        # shared between reads and only as aligned as the file's layout (complex kernels
        # crash on a complex128 tensor 8-byte aligned), so copy the real coordinates.
        _check_counter(f"vega.load: leaf {name!r} in {where}", name, got)
        fresh = torch.empty(got.shape, dtype=got.dtype, device=want.device).copy_(got)
        out[i] = torch.view_as_complex(fresh) if is_complex else fresh
    return out


def _check_counter(what: str, name: str, value: torch.Tensor) -> None:
    """A step counter (a leaf ``step``: a 0-d int32 tensor) holds a count in [0, 2**31 -
    1]: a negative one gives a step NaN values (a bias correction divides by 0), which a
    step cannot check without reading the device. Read here, outside any step."""
    if name.rsplit(".", 1)[-1] != "step" or value.dim() != 0 or value.dtype != torch.int32 \
            or value.device.type == "meta":
        return
    if int(value) < 0:
        raise ValueError(f"{what} is the step counter {int(value)}; a step counter counts the "
                         f"steps taken: a whole number in [0, 2**31 - 1]")


# -- one leaf -------------------------------------------------------------------------

def _find(state, name: str, who: str):
    named, leaves, spec = _named(state, who)
    if not isinstance(name, str):
        raise ValueError(f"{who}: a leaf name is a string such as 'step', got {name!r}")
    index = dict(named)
    if name not in index:
        raise ValueError(f"{who}: the state has no leaf {name!r}{_suggest(name, list(index))}")
    return index[name], leaves, spec


def get_leaf(state, name: str):
    """The leaf of ``state`` named ``name`` (one of ``vega.state_names(state)``)."""
    i, leaves, _ = _find(state, name, "vega.get_leaf")
    return leaves[i]


def set_leaf(state, name: str, value):
    """A new state with leaf ``name`` replaced by ``value``; ``state`` is left as it was.

    ``value`` must have the leaf's shape, dtype and device; a Python number is
    taken for a 0-d leaf (``set_leaf(state, "step", 100)``). The other leaves are
    shared with ``state``.
    """
    who = "vega.set_leaf"
    i, leaves, spec = _find(state, name, who)
    old = leaves[i]
    if isinstance(value, numbers.Number) and isinstance(old, torch.Tensor) and old.dim() == 0:
        kind = (numbers.Complex if old.is_complex() else numbers.Real if old.is_floating_point()
                else numbers.Integral)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{who}: leaf {name!r} is {old.dtype}; {value!r} does not fit it")
        try:
            value = torch.tensor(value, dtype=old.dtype, device=old.device)
        except (RuntimeError, OverflowError) as err:
            raise ValueError(f"{who}: leaf {name!r} is {old.dtype}; {value!r} does not fit "
                             "it") from err
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{who}: the value for leaf {name!r} must be a tensor, got "
                         f"{type(value).__name__}")
    if not dense(value):
        raise ValueError(f"{who}: the value for leaf {name!r} is {not_dense(value)}; a state "
                         "holds dense (strided) tensors")
    if isinstance(old, torch.Tensor):
        if value.dtype != old.dtype or value.shape != old.shape:
            raise ValueError(f"{who}: leaf {name!r} is {_describe(old)}; the value given is "
                             f"{_describe(value)}")
        if value.device != old.device:
            raise ValueError(f"{who}: leaf {name!r} is on {old.device}; the value given is on "
                             f"{value.device}")
    _check_counter(f"{who}: the value for leaf {name!r}", name, value)
    out = list(leaves)
    out[i] = value
    new = pytree.tree_unflatten(out, spec)
    _check_scales(f"{who}: leaf {name!r}", new)
    found = _scale_kind_mismatch(new)
    if found is not None and found[0] == name:  # (as vega.load and the constructor refuse)
        _, count, saved, given = found
        raise ValueError(f"{who}: leaf {name!r} would be {count}, the count of a {saved} loss "
                         f"scale, but the scale there is {given}: a static scale's good_steps "
                         "is -1, a dynamic one's counts its good steps from 0")
    if quant.SUFFIX in name and any(found == name for found, _ in q8_scales(state)):
        _no_negative_scale(f"{who}: the value for leaf", name, value)
    return new
