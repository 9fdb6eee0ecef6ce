// vega's C backend as a torch operator: vega_c::step and vega_c::prelude, over lists of
// tensors (Tensor[]), registered with TORCH_LIBRARY. They check the tensors through ATen's
// public API (data_ptr, numel, sizes, scalar_type, is_contiguous, device), build the address
// tables the generated kernels read (one row a tensor; the row layout is the program's, see
// vega.codegen.c.Kernel), and call the generated C kernels, which vega.codegen.c loads as
// plain shared libraries and registers here by the addresses of their entry points.
//
// The same functions are bound for Python with pybind11 (``step`` and ``prelude``): an eager
// step calls them directly, as torch.optim calls torch._fused_adamw_, and torch.compile
// traces the operators (their fake implementations, in Python, do nothing: every output is
// a mutated argument).
//
// A tensor the kernels cannot read as it is stored (not contiguous, with a negative or
// conjugate bit, not on the CPU, of another dtype) and anything else wrong raises
// ValueError before anything is written; vega.codegen.c then says which tensor, and steps
// contiguous copies where that is all that was wrong.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>  // at::empty (not every release includes it with Tensor.h)
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t FUSED_MAX = 65536;  // vega_fused steps tables of tensors no longer than this

using Entry = void (*)(int64_t, const int64_t *, const double *, double *, int);
using AxesEntry = void (*)(int64_t, const int64_t *, const double *, int);
using PreludeEntry = void (*)(int64_t, const int64_t *, double *, int);
using AdvanceEntry = void (*)(int64_t, const int64_t *, const double *);

// The entry points of one library: one (parameter, gradient, state) dtype triple.
struct Library {
    PreludeEntry prelude = nullptr;
    AdvanceEntry advance = nullptr;
    Entry update = nullptr;          // element-wise programs
    Entry fused = nullptr;           // (programs with reductions)
    AxesEntry axes_step = nullptr;   // matrix-view programs
    std::vector<Entry> phases;
};

// Where each column of a table row starts, and the row's width: given by
// vega.codegen.record.table_columns, the one definition the generated kernels read too.
struct Columns {
    int64_t numel, p, g, state, step, hyper, geo, p_out, state_out, width;
    int64_t ngeo() const { return p_out - geo; }  // geometry integers (a matrix-view program)
};

// What the tables of one program hold: see vega.codegen.c.Kernel.
struct Kernel {
    std::string name;
    int64_t nstates = 0, nphases = 0, nred = 0, nhyper = 0;
    bool axes = false;
    std::vector<int64_t> doms;  // each state's length: 0 its parameter's, 1-3 geometry[k],
                                // 4 one number, 5 one a block of 256
    std::vector<int64_t> wants;  // each state's dtype where the program fixes it (an 8-bit
                                 // state's codes: 1, uint8; its scales: 2, float32), else 0
    Columns col{};
    std::map<std::string, std::shared_ptr<const Library>> libs;  // "p g s" dtypes
};

std::mutex registry_lock;
std::atomic<int64_t> entry_calls{0};  // calls of the kernels' entry points, for the tests
std::unordered_map<int64_t, std::shared_ptr<Kernel>> registry;

[[noreturn]] void fail(const std::string &what) { throw std::invalid_argument(what); }

std::shared_ptr<Kernel> kernel_of(int64_t id) {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = registry.find(id);
    if (found == registry.end())
        throw std::runtime_error("vega: C kernel " + std::to_string(id) +
                                 " was released with its optimizer");
    return found->second;
}

const char *dtype_name(c10::ScalarType t) {
    switch (t) {
        case c10::ScalarType::Float: return "float32";
        case c10::ScalarType::Double: return "float64";
        case c10::ScalarType::BFloat16: return "bfloat16";
        case c10::ScalarType::Half: return "float16";
        case c10::ScalarType::Byte: return "uint8";  // a state's 8-bit codes (quant.py)
        default: return nullptr;
    }
}

// The error a missing library gives: Python builds it and calls again.
struct MissingLibrary : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::shared_ptr<const Library> library_of(const Kernel &k, const std::string &key) {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = k.libs.find(key);
    if (found == k.libs.end()) throw MissingLibrary(key);
    return found->second;
}

// Whether a kernel reads ``t`` at its address as it is: strided, contiguous, holding its
// values as stored (no negative or conjugate bit), of a dtype the kernels take.
bool as_stored(const at::Tensor &t) {
    return t.layout() == c10::kStrided && t.is_contiguous() && !t.is_neg() && !t.is_conj() &&
           dtype_name(t.scalar_type()) != nullptr;
}

// The axis of ``sizes`` of length ``n`` whose stride in a contiguous tensor is ``inner``
// (the last such, other than ``skip``), or -1: the row or column axis of a matrix view
// from its geometry row (``axis_geometry``: Sr, Sc, fr, fc). Where two axes match, every
// axis from one to the other has length 1, and removing either leaves the same shape.
int64_t view_axis(c10::IntArrayRef sizes, int64_t n, int64_t inner, int64_t skip) {
    int64_t stride = 1, found = -1;
    for (int64_t a = static_cast<int64_t>(sizes.size()) - 1; a >= 0; a--) {
        if (found < 0 && a != skip && sizes[a] == n && stride == inner) found = a;
        stride *= sizes[a];
    }
    return found;
}

// Whether state ``x`` of parameter ``p`` has the shape its domain needs: 0 the parameter's
// shape, 4 one number (a 0-d tensor), 5 one a block of 256 (8-bit scales), 1-3 (one per
// row, per column, per matrix) the parameter's without its column axis, its row axis or
// both, as ``geo`` (a matrix-view program's geometry row; none elsewhere) finds them: the
// length alone took a state of another shape (a row of (2, 2) for a (4, 6) parameter).
bool state_fits(const at::Tensor &x, const at::Tensor &p, int64_t dom, const int64_t *geo) {
    if (dom == 0) return x.sizes().equals(p.sizes());
    if (dom == 4) return x.dim() == 0;
    if (dom == 5) return x.dim() == 1 && x.numel() == (p.numel() + 255) / 256;
    if (geo == nullptr || x.numel() != geo[dom]) return false;
    const c10::IntArrayRef sizes = p.sizes();
    const int64_t c = p.dim() > 0 ? view_axis(sizes, geo[5], geo[7], -1) : -1;
    const int64_t r = p.dim() > 1 ? view_axis(sizes, geo[4], geo[6], c) : -1;
    const c10::IntArrayRef have = x.sizes();
    size_t j = 0;
    for (int64_t a = 0; a < p.dim(); a++) {
        if ((a == c && dom != 2) || (a == r && dom != 1)) continue;  // (an axis it lacks)
        if (j == have.size() || have[j++] != sizes[a]) return false;
    }
    return j == have.size();
}

// Whether ``t`` is a step counter a kernel advances on ``device``: a 0-d int32 tensor.
bool is_counter(const at::Tensor &t, const c10::Device &device) {
    return t.defined() && t.layout() == c10::kStrided && t.device() == device &&
           t.scalar_type() == c10::ScalarType::Int && t.dim() == 0;
}

// Tensors held by pointer, read as a list (``step_impl``'s eager lists, ``dtype_code``).
struct Pointed {
    const std::vector<const at::Tensor *> &ts;
    size_t size() const { return ts.size(); }
    bool empty() const { return ts.empty(); }
    const at::Tensor &operator[](size_t k) const { return *ts[k]; }
};

// The address of a tensor a kernel reads (and writes) there: a CPU tensor ``as_stored``
// (uint8 only for 8-bit codes). (Read once: each read is a call into its storage.)
int64_t check_plain(const at::Tensor &t, const char *what, size_t i, bool codes = false) {
    if (!t.defined()) fail(std::string("backend 'c': ") + what + " " + std::to_string(i) +
                           " is undefined (None)");
    const bool stored = as_stored(t);
    const auto at = static_cast<int64_t>(reinterpret_cast<intptr_t>(
        stored ? t.data_ptr() : nullptr));
    if (!stored || !t.device().is_cpu() ||
        (!codes && t.scalar_type() == c10::ScalarType::Byte) || (t.numel() && at == 0))
        fail(std::string("backend 'c': ") + what + " " + std::to_string(i) +
             " is not a contiguous CPU tensor of float32, float64, bfloat16 or float16 "
             "holding its values as stored");
    return at;
}

struct Span {
    uintptr_t lo, hi;
};

// How far ahead a pass over Python objects asks the cache for the next ones: a step over
// many small tensors runs after a training step that pushed them out of the cache.
constexpr Py_ssize_t PREFETCH_AHEAD = 8;

// What a step over many small tensors waits for most, around its kernels, is each tensor's
// metadata coming from memory, where a training step in between pushed it out of the cache.
// One pointer leads to the next (the Python object, the tensor, its storage), and checks that
// go tensor after tensor, each a long run of code, would wait for one such chain at a time.
// So a pass over tensors asks the cache for those a few places ahead, a link of the chain at
// a time (``prefetch_ahead``): 1,000 one-element parameters stepped with a torch step in
// between, a class step's cost around its kernels came to 0.33-0.35 of torch's fused step's
// against 0.36-0.39 without (three interleaved pairs of runs, docs/performance.md). These
// are hints: an address is taken through torch's public API (the tensor's object; its
// storage's, read from the tensor's object once that has come), and the lines it spans are
// asked for (a prefetch of any address never faults). What is read to find an address is
// read through public accessors of objects the pass holds, as the pass reads them a few
// places later (gather's: a parameter's grad(), a state dict's first entries by PyDict_Next).
inline void prefetch_lines(const void *at, size_t bytes) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(at) & ~uintptr_t{63},
                    end = reinterpret_cast<uintptr_t>(at) + bytes;
    for (uintptr_t line = first; line < end; line += 64)
        __builtin_prefetch(reinterpret_cast<const void *>(line));
}

inline void prefetch_tensor(const at::Tensor &t) {
    prefetch_lines(t.unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
}

// (once the tensor's object has come)
inline void prefetch_storage(const at::Tensor &t) {
    prefetch_lines(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(),
                   sizeof(c10::StorageImpl));
}

// In a pass over ``n`` tensors at ``at(i)`` (a tensor, or null for none), at ``i``: the
// tensor ``PREFETCH_AHEAD`` places ahead asked for, and the storage of the one half as far.
template <class At>
void prefetch_ahead(size_t n, size_t i, const At &at) {
    if (i + PREFETCH_AHEAD < n)
        if (const at::Tensor *t = at(i + PREFETCH_AHEAD)) prefetch_tensor(*t);
    if (i + PREFETCH_AHEAD / 2 < n)
        if (const at::Tensor *t = at(i + PREFETCH_AHEAD / 2)) prefetch_storage(*t);
}

// ``prefetch_ahead`` over Python objects (their tensors where exactly a Tensor or a
// Parameter), the objects themselves asked for twice as far ahead.
inline void prefetch_objects(PyObject *const *X, size_t n, size_t i) {
    if (i + 2 * PREFETCH_AHEAD < n) __builtin_prefetch(X[i + 2 * PREFETCH_AHEAD]);
    prefetch_ahead(n, i, [&](size_t k) {
        return THPVariable_CheckExact(X[k]) ? &THPVariable_Unpack(X[k]) : nullptr;
    });
}

// A tensor written in place: its version counter advanced, as an in-place torch operation
// advances it (an inference tensor keeps none).
void bump(const at::Tensor &t) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

// In a pass over ``n`` tensors at ``at(i)``, at ``i``: ``bump(at(i))``, the counter of the
// tensor ``PREFETCH_AHEAD`` places on read first (as ``prefetch_ahead`` asks ahead): an
// atomic increment waits for its line.
template <class At>
void bump_ahead(size_t n, size_t i, const At &at) {
    if (i + PREFETCH_AHEAD < n) {
        const at::Tensor &ahead = at(i + PREFETCH_AHEAD);
        if (!ahead.is_inference()) (void)ahead._version();
    }
    bump(at(i));
}

// A C step's own passes over tensors (``step_impl``'s, ``prelude_impl``'s) ask in chunks
// instead: at the first position of each run of ``PREFETCH_CHUNK``, every tensor of the run,
// then every storage of the run (``prefetch_tensors``), each a burst of independent requests
// that come together, where asking a few places ahead kept fewer in flight. Over 1,000
// one-element parameters stepped in turn with torch's fused step, the operator's call took a
// median 0.55-0.77 ms (eight runs) against 0.63-0.86 ms asking a few places ahead (seven
// runs, interleaved with those). ``gather``'s chains are longer (the parameter's object, its
// tensor, its autograd metadata, the gradient's tensor): asked a chunk at a time, link after
// link, it took longer (four interleaved pairs of runs), and asks a few places ahead still.
constexpr size_t PREFETCH_CHUNK = 64;

// In a run [lo, hi) of a pass, at ``i``: ``warm(i, end)`` where ``i`` starts a chunk (or the
// run), for the chunk's positions [i, end).
template <class Warm>
inline void warm_chunk(size_t lo, size_t hi, size_t i, const Warm &warm) {
    if (i == lo || i % PREFETCH_CHUNK == 0)
        warm(i, std::min(hi, (i / PREFETCH_CHUNK + 1) * PREFETCH_CHUNK));
}

// The tensors ``each(k, f)`` passes to ``f`` for each position k of [from, to) asked for,
// then their storages.
template <class Each>
void prefetch_tensors(size_t from, size_t to, const Each &each) {
    for (size_t k = from; k < to; k++) each(k, prefetch_tensor);
    for (size_t k = from; k < to; k++) each(k, prefetch_storage);
}

// Whether two of the tensors written in place share memory (each contiguous: its span is
// its memory). The spans of this thread's last few calls that shared none are kept, the
// latest first: the same tensors again are not sorted again, in a training loop and where
// optimizers take turns (a GAN's two; a benchmark's rows, where one kept call, sorted again
// each turn, was a fifth of a step over 1,000 one-element parameters).
constexpr size_t SPANS_KEPT = 4;

// Written spans that share no memory, sorted by their starts, with how far those up to each
// reach: a span of ``reads`` meets one of them where the last that starts before its end
// reaches past its start (a binary search: no sort, nothing made).
struct Sorted {
    std::vector<Span> spans;          // (as given: the key of the cache below)
    std::vector<uintptr_t> lo, reach;
    bool meets(const std::vector<Span> &reads) const {
        for (const Span &r : reads) {
            if (r.hi <= r.lo) continue;
            auto it = std::lower_bound(lo.begin(), lo.end(), r.hi);  // (the first at r.hi on)
            if (it != lo.begin() && reach[static_cast<size_t>(it - lo.begin()) - 1] > r.lo)
                return true;
        }
        return false;
    }
};

// Whether two of ``spans`` (written) share memory, or one of ``reads`` (the gradients: a
// kernel could read one after writing there) shares memory with one of them (kept, above:
// the gradients, new each step after a backward pass, are looked up in the written spans).
bool any_shared(const std::vector<Span> &spans, const std::vector<Span> &reads = {}) {
    thread_local std::vector<Sorted> kept;
    for (size_t k = 0; k < kept.size(); k++)
        if (kept[k].spans.size() == spans.size() &&
            std::memcmp(kept[k].spans.data(), spans.data(), spans.size() * sizeof(Span)) == 0) {
            std::rotate(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(k),
                        kept.begin() + static_cast<std::ptrdiff_t>(k) + 1);
            return kept[0].meets(reads);
        }
    std::vector<Span> sorted;
    sorted.reserve(spans.size());
    for (const Span &s : spans)
        if (s.hi > s.lo) sorted.push_back(s);
    std::sort(sorted.begin(), sorted.end(),
              [](const Span &a, const Span &b) { return a.lo < b.lo; });
    Sorted made{spans, {}, {}};
    made.lo.reserve(sorted.size());
    made.reach.reserve(sorted.size());
    uintptr_t reach = 0;
    for (size_t k = 0; k < sorted.size(); k++) {
        if (k && sorted[k].lo < reach) return true;
        reach = std::max(reach, sorted[k].hi);
        made.lo.push_back(sorted[k].lo);
        made.reach.push_back(reach);
    }
    const bool read_meets = made.meets(reads);
    if (kept.size() == SPANS_KEPT) kept.pop_back();
    kept.insert(kept.begin(), std::move(made));
    return read_meets;
}

// The memory of contiguous ``t`` whose first element is at ``lo``.
Span span_at(uintptr_t lo, const at::Tensor &t) {
    return {lo, lo + static_cast<uintptr_t>(t.numel()) * t.element_size()};
}

Span span_of(const at::Tensor &t) { return span_at(reinterpret_cast<uintptr_t>(t.data_ptr()), t); }

// The prelude's record: a contiguous float64 CPU tensor of its slots (or none).
double *record_of(const c10::optional<at::Tensor> &pre) {
    if (!pre.has_value() || !pre->defined()) return nullptr;
    const at::Tensor &r = *pre;
    if (r.layout() != c10::kStrided || !r.device().is_cpu() || !r.is_contiguous() ||
        r.scalar_type() != c10::ScalarType::Double || r.numel() < 5 || r.data_ptr() == nullptr)
        fail("backend 'c': the prelude's record must be a contiguous float64 CPU tensor");
    return r.data_ptr<double>();
}

struct Group {
    std::shared_ptr<const Library> lib;
    std::vector<int64_t> rows;  // the address table, row after row
    int64_t n = 0, largest = 0, total = 0;
    std::string key;  // "p g s" dtypes
    uint64_t code = 0;  // the same, packed (dtype_code)
    std::vector<int64_t> at;  // its parameters' positions (kept for ``tables`` only)
};


// The dtypes of a parameter, its gradient and its states packed in one number, 8 bits each,
// compared before any string is made; OTHER_CODES where more than five states do not fit,
// whose groups are told apart by their ``dtype_key`` strings.
constexpr uint64_t OTHER_CODES = ~0ull;

template <class List>
uint64_t dtype_code(const at::Tensor &p, c10::ScalarType g, const List &states, size_t i,
                    size_t n, size_t ns) {
    if (ns > 5) return OTHER_CODES;
    uint64_t code = static_cast<uint64_t>(p.scalar_type()) | static_cast<uint64_t>(g) << 8;
    for (size_t s = 0; s < ns; s++)
        code |= static_cast<uint64_t>(states[s * n + i].scalar_type()) << (16 + 8 * s);
    return code;
}

// "p g s": the dtype names of a parameter, its gradient and its states (one name where the
// states share a dtype, else each's, comma-separated: vega.codegen.c's state_key).
template <class List>
std::string dtype_key(const at::Tensor &p, const at::Tensor &g, const List &states, size_t i,
                      size_t n, size_t ns) {
    std::string key = std::string(dtype_name(p.scalar_type())) + " " +
                      dtype_name(g.scalar_type()) + " ";
    bool mixed = false;
    for (size_t s = 1; s < ns; s++)
        mixed |= states[s * n + i].scalar_type() != states[i].scalar_type();
    if (!mixed) return key + dtype_name((ns ? states[i] : p).scalar_type());
    for (size_t s = 0; s < ns; s++)
        key += std::string(s ? "," : "") + dtype_name(states[s * n + i].scalar_type());
    return key;
}

// The group of the dtypes ``code`` among ``groups`` (a Group, or anything with its ``code``
// and ``key``), or null; ``named`` keeps ``key()`` once made (to tell OTHER_CODES apart).
template <class G, class MakeKey>
G *found_group(std::vector<G> &groups, uint64_t code, const MakeKey &key, std::string &named) {
    for (G &grp : groups)
        if (grp.code == code) {
            if (code != OTHER_CODES) return &grp;
            if (named.empty()) named = key();
            if (grp.key == named) return &grp;
        }
    return nullptr;
}

// The group of the dtypes ``code`` among ``groups``, made with its library when new (its
// name, ``key()``, made only then).
template <class MakeKey>
Group &group_of(std::vector<Group> &groups, const Kernel &k, uint64_t code,
                const MakeKey &key) {
    std::string named;
    if (Group *grp = found_group(groups, code, key, named)) return *grp;
    if (named.empty()) named = key();
    groups.emplace_back();
    groups.back().key = named;
    groups.back().code = code;
    groups.back().lib = library_of(k, named);
    return groups.back();
}

// ``check(i)`` for i in [0, n), on the intra-op threads where ``apart`` (``wide``): what a
// step over many tensors takes longest over around its kernels is waiting for each tensor's
// metadata to come from memory, and two threads wait for twice as much at once. Each thread
// takes a run of i and stops at its first error; the error of the lowest i is raised, the
// one a loop in order raises.
constexpr size_t APART_MIN = 64;  // fewer tensors than this are checked on one thread
// The kernels' PAR_MIN (vega.codegen.c.render): a step of fewer elements runs its kernels on
// one thread, and is checked on one. A parallel region waits for every thread of its team,
// and on a busy machine one may not be running: a step that has to wait so for its kernels
// anyway may wait for its checks too, but a step of small tensors, whose kernels run on this
// thread alone, must not (with another process busy on the other core of two, 1,000
// one-element tensors took 20 ms a step checked on two threads, against 1.3 ms on one).
constexpr int64_t APART_ELEMENTS = 32768;

// Whether ``each_apart`` of the tensors ``ts`` runs on several threads: many tensors, whose
// elements (the first ``APART_MIN``'s, as many times over as the list holds) are many too.
template <class List>
bool wide(const List &ts) {
    const size_t n = ts.size();
    if (n < APART_MIN || at::get_num_threads() < 2 || at::in_parallel_region()) return false;
    int64_t seen = 0;
    try {  // (a tensor whose numel raises is named by the checks, on one thread)
        for (size_t i = 0; i < APART_MIN; i++) seen += ts[i].defined() ? ts[i].numel() : 0;
    } catch (const std::exception &) {
        return false;
    }
    return seen * static_cast<int64_t>(n / APART_MIN) >= APART_ELEMENTS;
}

// (``warm``: the chunks' prefetches, ``warm_chunk``)
template <class Warm, class Check>
void each_apart(size_t n, bool apart, const Warm &warm, const Check &check) {
    if (!apart) {
        for (size_t i = 0; i < n; i++) {
            warm_chunk(0, n, i, warm);
            check(i);
        }
        return;
    }
    std::mutex lock;
    size_t bad = n;
    std::exception_ptr error;
    at::parallel_for(0, static_cast<int64_t>(n), APART_MIN / 2, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; i++) {
            try {
                warm_chunk(static_cast<size_t>(lo), static_cast<size_t>(hi),
                           static_cast<size_t>(i), warm);
                check(static_cast<size_t>(i));
            } catch (...) {
                std::lock_guard<std::mutex> guard(lock);
                if (static_cast<size_t>(i) < bad) {
                    bad = static_cast<size_t>(i);
                    error = std::current_exception();
                }
                return;
            }
        }
    });
    if (error) std::rethrow_exception(error);
}

// ``List``: at::TensorList (the operator's), or ``Pointed`` (the eager call's: by pointer).
// ``bump``: a step in place advances the parameters' version counters, as an in-place torch
// operation does (the eager call's; the operator's dispatch does its own), once every tensor
// is checked and before the kernels run: each parameter's tensor is still in the cache
// then, where the kernels' pass over the values pushes it out. ``keep``: every tensor
// checked and each dtype group's rows built, kept there, and no kernel run (``tables``).
template <class List>
void step_impl(int64_t id, const List &params, const List &grads, const List &states,
               const List &steps, c10::IntArrayRef step_index, const List &hypers,
               c10::IntArrayRef hyper_index, const c10::optional<at::Tensor> &pre,
               c10::IntArrayRef geometry, const List &outs, bool bump = false,
               std::vector<Group> *keep = nullptr) {
    auto k = kernel_of(id);
    const size_t n = params.size(), ns = static_cast<size_t>(k->nstates);
    const bool in_place = outs.empty();
    const size_t ngeo = k->axes ? static_cast<size_t>(k->col.ngeo()) * n : 0;
    if (grads.size() != n || states.size() != ns * n || step_index.size() != n ||
        hyper_index.size() != n || geometry.size() != ngeo ||
        (!in_place && outs.size() != (ns + 1) * n))
        fail("backend 'c': the lists of a step do not match: " + std::to_string(n) +
             " parameters, " + std::to_string(grads.size()) + " gradients, " +
             std::to_string(states.size()) + " state tensors for " + std::to_string(ns) +
             " states, " + std::to_string(step_index.size()) + " step indices, " +
             std::to_string(hyper_index.size()) + " hyperparameter indices");
    const bool inference_mode = c10::InferenceMode::is_enabled();
    // the step counters: 0-d int32 CPU tensors (their spans after the parameters')
    const size_t nt = steps.size();
    std::vector<int64_t> step_at(nt);
    std::vector<Span> spans(in_place ? n * (ns + 1) + nt : 0),
        reads(in_place ? n : 0);  // (the gradients: none may share memory a step writes)
    const bool apart = wide(params);
    const auto warm_steps = [&](size_t from, size_t to) {
        prefetch_tensors(from, to, [&](size_t k, auto ask) { ask(steps[k]); });
    };
    each_apart(nt, apart && nt >= APART_MIN, warm_steps, [&](size_t j) {
        const at::Tensor &t = steps[j];
        if (!is_counter(t, c10::Device(c10::kCPU)))
            fail("backend 'c': a step counter must be a 0-d int32 tensor on the CPU");
        if (in_place && t.is_inference() && !inference_mode)
            fail("backend 'c': an inference tensor cannot be written in place outside "
                 "inference mode");
        step_at[j] = reinterpret_cast<intptr_t>(t.data_ptr());
        // (a tensor without memory, functionalize's wrapper: address 0)
        if (step_at[j] == 0) fail("backend 'c': a step counter has no storage");
        __builtin_prefetch(reinterpret_cast<const void *>(step_at[j]), 1);
        if (in_place) spans[n * (ns + 1) + j] = span_at(static_cast<uintptr_t>(step_at[j]), t);
    });
    // the hyperparameter rows: contiguous float64 CPU arrays, a 1-d array one row
    std::vector<int64_t> hyp_at;
    for (size_t j = 0; j < hypers.size(); j++) {
        const at::Tensor &h = hypers[j];
        if (!h.defined() || h.layout() != c10::kStrided || !h.device().is_cpu() ||
            h.scalar_type() != c10::ScalarType::Double || !h.is_contiguous() ||
            h.dim() < 1 || h.dim() > 2 || h.size(-1) < k->nhyper)
            fail("backend 'c': hyperparameters must be contiguous float64 CPU rows of " +
                 std::to_string(k->nhyper));
        auto base = reinterpret_cast<intptr_t>(h.data_ptr());
        if (base == 0) fail("backend 'c': a hyperparameter row has no storage");
        int64_t rows = h.dim() == 1 ? 1 : h.size(0), width = h.size(-1) * 8;
        for (int64_t r = 0; r < rows; r++) hyp_at.push_back(base + r * width);
    }
    double *record = record_of(pre);
    std::vector<int64_t> out_at(outs.size());
    // (uint8: an 8-bit state's new codes; each output is checked below to be of its input's
    // dtype)
    for (size_t i = 0; i < outs.size(); i++) out_at[i] = check_plain(outs[i], "output", i, true);
    // every tensor checked (``each_apart``: on several threads), what each parameter's
    // rows need kept: its length, the addresses of it, its gradient and its states, and its
    // dtypes packed (``dtype_code``)
    const size_t fw = ns + 4;
    std::vector<int64_t> found(n * fw);
    const auto warm = [&](size_t from, size_t to) {
        prefetch_tensors(from, to, [&](size_t k, auto ask) {
            ask(params[k]);
            ask(grads[k]);
            for (size_t s = 0; s < ns; s++) ask(states[s * n + k]);
        });
    };
    each_apart(n, apart, warm, [&](size_t i) {
        const at::Tensor &p = params[i], &g = grads[i];
        int64_t *f = found.data() + i * fw;
        f[1] = check_plain(p, "parameter", i);
        f[2] = check_plain(g, "gradient", i);
        if (in_place) reads[i] = span_at(static_cast<uintptr_t>(f[2]), g);
        if (!p.sizes().equals(g.sizes()))
            fail("backend 'c': gradient " + std::to_string(i) +
                 "'s shape differs from its parameter's");
        const int64_t *geo = k->axes ? geometry.data() + k->col.ngeo() * i : nullptr;
        if (geo && geo[0] != p.numel()) fail("backend 'c': a geometry row does not match");
        for (size_t s = 0; s < ns; s++) {
            const at::Tensor &x = states[s * n + i];
            f[3 + s] = check_plain(x, "state tensor", s * n + i, true);
            if (!state_fits(x, p, k->doms[s], geo))
                fail("backend 'c': state " + std::to_string(s) + " of parameter " +
                     std::to_string(i) + " has the wrong shape");
            // (a library is found by the dtypes of its tensors; a program's 8-bit codes and
            // scales are read as theirs, whatever its key says)
            if (k->wants[s] && x.scalar_type() != (k->wants[s] == 1 ? c10::ScalarType::Byte
                                                                      : c10::ScalarType::Float))
                fail("backend 'c': state " + std::to_string(s) + " of parameter " +
                     std::to_string(i) + " is not of the dtype its 8-bit state keeps");
        }
        if (step_index[i] < 0 || step_index[i] >= static_cast<int64_t>(nt) ||
            hyper_index[i] < 0 || hyper_index[i] >= static_cast<int64_t>(hyp_at.size()))
            fail("backend 'c': a step or hyperparameter index is out of range");
        for (size_t s = 0; s <= ns; s++) {
            const at::Tensor &in = s == 0 ? p : states[(s - 1) * n + i];
            if (in_place) {
                if (in.is_inference() && !inference_mode)
                    fail("backend 'c': an inference tensor cannot be written in place "
                         "outside inference mode");
                spans[i * (ns + 1) + s] = span_at(static_cast<uintptr_t>(f[s == 0 ? 1 : 2 + s]),
                                                  in);
            } else if (!outs[s * n + i].sizes().equals(in.sizes())) {
                fail("backend 'c': an output's shape differs from its input's");
            } else if (outs[s * n + i].scalar_type() != in.scalar_type()) {
                // (the kernels write each new tensor in its input's dtype: another would be
                // reinterpreted, or written past its end)
                const char *want = dtype_name(in.scalar_type());
                fail("backend 'c': output " + std::to_string(s * n + i) + " (" +
                     (s == 0 ? std::string() : "state " + std::to_string(s - 1) + " of ") +
                     "parameter " + std::to_string(i) + ") is of dtype " +
                     dtype_name(outs[s * n + i].scalar_type()) + ", its input's " +
                     (want ? want : "another") + "; each output takes its input's dtype");
            }
        }
        f[0] = p.numel();
        f[3 + ns] = static_cast<int64_t>(dtype_code(p, g.scalar_type(), states, i, n, ns));
        // the first values the kernels read (the gradient's) and write (the parameter's and
        // the states'), asked for while the others are checked
        __builtin_prefetch(reinterpret_cast<const void *>(f[2]));
        __builtin_prefetch(reinterpret_cast<const void *>(f[1]), 1);
        for (size_t s = 0; s < ns; s++)
            __builtin_prefetch(reinterpret_cast<const void *>(f[3 + s]), 1);
    });
    // (a step counter shared by several parameters appears once)
    if (in_place && any_shared(spans, reads))
        fail("backend 'c': two tensors a step writes share memory, or a gradient shares "
             "memory with one");
    // the rows, the parameters grouped by dtypes
    std::vector<Group> groups;
    const int64_t width = k->col.width;
    const Columns &c = k->col;
    for (size_t i = 0; i < n; i++) {
        const int64_t *f = found.data() + i * fw;
        Group &grp = group_of(groups, *k, static_cast<uint64_t>(f[3 + ns]), [&] {
            return dtype_key(params[i], grads[i], states, i, n, ns);
        });
        const size_t at = grp.rows.size();
        grp.rows.resize(at + width, 0);
        int64_t *row = grp.rows.data() + at;
        row[c.numel] = f[0];
        row[c.p] = f[1];
        row[c.g] = f[2];
        for (size_t s = 0; s < ns; s++) row[c.state + s] = f[3 + s];
        row[c.step] = step_at[step_index[i]];
        row[c.hyper] = hyp_at[hyper_index[i]];
        if (k->axes) {
            const int64_t *geo = geometry.data() + c.ngeo() * i;
            std::copy(geo, geo + c.ngeo(), row + c.geo);
        }
        for (size_t s = 0; s <= ns; s++)
            row[s == 0 ? c.p_out : c.state_out + s - 1] =
                in_place ? f[s == 0 ? 1 : 2 + s] : out_at[s * n + i];
        grp.n++;
        grp.largest = std::max(grp.largest, f[0]);
        grp.total += f[0];
        if (keep) grp.at.push_back(static_cast<int64_t>(i));
    }
    if (keep) {  // (the caller runs the kernels, and advances the versions it writes)
        *keep = std::move(groups);
        return;
    }
    // (every library is found: nothing after this refuses the step)
    if (bump && in_place)  // (each chunk's counters read first: an atomic increment waits)
        each_apart(n, apart, [&](size_t from, size_t to) {
            for (size_t k = from; k < to; k++)
                if (!params[k].is_inference()) (void)params[k]._version();
        }, [&](size_t i) { ::bump(params[i]); });
    if (groups.empty()) return;
    const int nth = at::get_num_threads();
    std::vector<std::vector<double>> reds(groups.size());
    for (size_t gi = 0; gi < groups.size(); gi++)
        reds[gi].assign(std::max<int64_t>(1, groups[gi].n * k->nred), 0.0);
    for (size_t gi = 0; gi < groups.size(); gi++) {
        Group &grp = groups[gi];
        const Library &lib = *grp.lib;
        const int64_t *tab = grp.rows.data();
        double *red = reds[gi].data();
        if (k->axes) {
            lib.axes_step(grp.n, tab, record, nth);
            entry_calls++;
        } else if (k->nphases && grp.largest <= FUSED_MAX &&
                   grp.total >= 4 * std::max(nth, 1) * grp.largest) {
            lib.fused(grp.n, tab, record, red, nth);
            entry_calls++;
        } else {
            for (const Entry phase : lib.phases) phase(grp.n, tab, record, red, nth);
            lib.update(grp.n, tab, record, red, nth);
            entry_calls += 1 + static_cast<int64_t>(lib.phases.size());
        }
    }
    groups.back().lib->advance(static_cast<int64_t>(step_at.size()), step_at.data(), record);
    entry_calls++;
}

template <class List>
void prelude_impl(int64_t id, const List &grads, const at::Tensor &pre) {
    auto k = kernel_of(id);
    double *record = record_of(pre.defined() ? c10::optional<at::Tensor>(pre) : c10::nullopt);
    if (record == nullptr) fail("backend 'c': the prelude needs its record");
    const int64_t width = k->col.width;
    // each gradient's address, length and dtype (on several threads: ``each_apart``)
    const size_t n = grads.size();
    std::vector<int64_t> found(3 * n);
    each_apart(n, wide(grads), [&](size_t from, size_t to) {
        prefetch_tensors(from, to, [&](size_t k, auto ask) { ask(grads[k]); });
    }, [&](size_t i) {
        const at::Tensor &g = grads[i];
        found[3 * i] = check_plain(g, "gradient", i);
        found[3 * i + 1] = g.numel();
        found[3 * i + 2] = static_cast<int64_t>(g.scalar_type());
    });
    std::vector<Group> groups;
    for (size_t i = 0; i < n; i++) {
        const auto t = static_cast<uint64_t>(found[3 * i + 2]);
        const char *d = dtype_name(static_cast<c10::ScalarType>(t));
        Group &grp = group_of(groups, *k, t | t << 8 | t << 16,
                              [&] { return std::string(d) + " " + d + " " + d; });
        size_t at = grp.rows.size();
        grp.rows.resize(at + width, 0);
        grp.rows[at + k->col.numel] = found[3 * i + 1];
        grp.rows[at + k->col.g] = found[3 * i];
        grp.n++;
    }
    const int nth = at::get_num_threads();
    for (Group &grp : groups) {
        grp.lib->prelude(grp.n, grp.rows.data(), record, nth);
        entry_calls++;
    }
}

// -- the operators -------------------------------------------------------------------------

void step_op(int64_t id, at::TensorList params, at::TensorList grads, at::TensorList states,
             at::TensorList steps, at::IntArrayRef step_index, at::TensorList hypers,
             at::IntArrayRef hyper_index, const c10::optional<at::Tensor> &pre,
             at::IntArrayRef geometry, at::TensorList outs) {
    step_impl(id, params, grads, states, steps, step_index, hypers, hyper_index, pre, geometry,
              outs);
}

void prelude_op(int64_t id, at::TensorList grads, const at::Tensor &pre) {
    prelude_impl(id, grads, pre);
}

}  // namespace

TORCH_LIBRARY(vega_c, m) {
    m.def("step(int kernel, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, "
          "Tensor(c!)[] steps, int[] step_index, Tensor[] hypers, int[] hyper_index, "
          "Tensor(d!)? pre, int[] geometry, Tensor(e!)[] outs) -> ()");
    m.def("prelude(int kernel, Tensor[] grads, Tensor(a!) pre) -> ()");
}

TORCH_LIBRARY_IMPL(vega_c, CPU, m) {
    m.impl("step", &step_op);
    m.impl("prelude", &prelude_op);
}

// -- Python --------------------------------------------------------------------------------

namespace py = pybind11;

// The tensors of a Python sequence (None an undefined tensor), each taken from its Python
// object by torch's own accessor (THPVariable_Unpack, what torch's pybind11 caster calls),
// by pointer: a tuple of the objects keeps them alive (and the list as it was) while the
// step runs without the GIL. Converting a list argument through the caster costs 80-95 ns a
// tensor; copying each at::Tensor, about 15 ns plus an atomic reference count taken and
// dropped; this, a Python reference each, taken with the GIL held.
// Made with the GIL held, and destroyed so.
struct Held {
    py::object tuple;
    std::vector<const at::Tensor *> ts;
    Pointed list() const { return {ts}; }
    // The objects' heads asked for, for writing: a step's kernels push them out of the
    // cache, and the Python that follows counts references to each (this tuple's, then the
    // caller's lists'), object after object; asked for in one pass, they come in parallel.
    // With ``step_impl``'s ``bump`` before the kernels, a class step over 1,000 parameters of
    // 10k elements or fewer, raced with torch's fused step, took 3.93 ms against 4.04 (the
    // mean of eight interleaved runs' medians), and over 1,000 of one element 0.73 against
    // 0.82 (ten runs). Needs no GIL: the tuple is not changed.
    void prefetch() const {
        const Py_ssize_t n = PyTuple_GET_SIZE(tuple.ptr());
        PyObject *const *items = &PyTuple_GET_ITEM(tuple.ptr(), 0);
        for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(items[i], 1);
    }
};

Held tensors_of(py::handle seq, const char *what) {
    static const at::Tensor undefined;
    Held out{py::reinterpret_steal<py::object>(PySequence_Tuple(seq.ptr())), {}};
    if (!out.tuple) throw py::error_already_set();
    const Py_ssize_t n = PyTuple_GET_SIZE(out.tuple.ptr());
    out.ts.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n)
            __builtin_prefetch(PyTuple_GET_ITEM(out.tuple.ptr(), i + PREFETCH_AHEAD));
        PyObject *x = PyTuple_GET_ITEM(out.tuple.ptr(), i);
        if (x == Py_None) out.ts.push_back(&undefined);
        else if (THPVariable_Check(x)) out.ts.push_back(&THPVariable_Unpack(x));
        else
            throw py::type_error(std::string("vega_native: ") + what + " " + std::to_string(i) +
                                 " is a " + Py_TYPE(x)->tp_name + ", not a tensor");
    }
    return out;
}

// The items of a Python sequence as a tuple (a TypeError naming ``what`` for another
// object).
py::tuple tuple_of(py::handle seq, const char *what) {
    PyObject *t = PySequence_Tuple(seq.ptr());
    if (t == nullptr) {
        PyErr_Clear();
        throw py::type_error(std::string(what) + " must be a sequence, not " +
                             Py_TYPE(seq.ptr())->tp_name);
    }
    return py::reinterpret_steal<py::tuple>(t);
}

// The integers of a Python sequence (pybind11's conversion of a list costs ~30 ns an item).
std::vector<int64_t> ints_of(py::handle seq, const char *what) {
    const py::tuple items = tuple_of(seq, (std::string("vega_native: ") + what).c_str());
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    PyObject **X = &PyTuple_GET_ITEM(items.ptr(), 0);
    std::vector<int64_t> out(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(X[i]))
            throw py::type_error(std::string("vega_native: ") + what + " " + std::to_string(i) +
                                 " is a " + Py_TYPE(X[i])->tp_name + ", not an int");
        out[i] = PyLong_AsLongLong(X[i]);
        if (out[i] == -1 && PyErr_Occurred()) throw py::error_already_set();
    }
    return out;
}

// A step's index of each parameter's step counter or hyperparameter row (``ints_of``),
// without an int read a parameter in the common cases: ``range(n)``, each parameter its own
// (``distinct``'s answer where every counter is distinct), and None, one row for all.
std::vector<int64_t> indices_of(py::handle seq, size_t n, const char *what) {
    std::vector<int64_t> out(n, 0);
    if (seq.is_none()) return out;
    if (PyRange_Check(seq.ptr())) {
        py::object all = py::reinterpret_steal<py::object>(PyObject_CallFunction(
            reinterpret_cast<PyObject *>(&PyRange_Type), "n", static_cast<Py_ssize_t>(n)));
        if (!all) throw py::error_already_set();
        const int same = PyObject_RichCompareBool(seq.ptr(), all.ptr(), Py_EQ);
        if (same < 0) throw py::error_already_set();
        if (same) {
            for (size_t i = 0; i < n; i++) out[i] = static_cast<int64_t>(i);
            return out;
        }
    }
    return ints_of(seq, what);
}

// A step's arguments as the eager calls take them (``step``, ``tables``), converted with the
// GIL held; ``run`` does the work without it. Made and destroyed with the GIL held.
struct EagerArgs {
    Held p, g, s, t, h, o;
    std::vector<int64_t> step_index, hyper_index, geometry;
    EagerArgs(py::handle params, py::handle grads, py::handle states, py::handle steps,
              py::handle step_index_, py::handle hypers, py::handle hyper_index_,
              py::handle geometry_, py::handle outs)
        : p(tensors_of(params, "parameter")), g(tensors_of(grads, "gradient")),
          s(tensors_of(states, "state tensor")), t(tensors_of(steps, "step counter")),
          h(tensors_of(hypers, "hyperparameter row")), o(tensors_of(outs, "output")),
          step_index(indices_of(step_index_, p.ts.size(), "step index")),
          hyper_index(indices_of(hyper_index_, p.ts.size(), "hyperparameter index")),
          geometry(ints_of(geometry_, "geometry")) {}
    // ``step_impl`` (``bump``, ``keep``: its own), then the tensors' objects asked for
    void run(int64_t id, const c10::optional<at::Tensor> &pre, bool bump,
             std::vector<Group> *keep) const {
        py::gil_scoped_release unlocked;
        step_impl(id, p.list(), g.list(), s.list(), t.list(), step_index, h.list(), hyper_index,
                  pre, geometry, o.list(), bump, keep);
        for (const Held *held : {&p, &g, &s, &t}) held->prefetch();
    }
};

// -- Triton's address tables -----------------------------------------------------------------

// Raised where a Triton step's tensors are not all plain and as its kernels read them:
// vega.codegen.triton_runtime then takes its Python path, which says what is wrong or steps
// copies (a ValueError in Python).
struct Refused : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// A Triton step's tensor as its kernels read and write it in place: a Tensor or Parameter (no
// subclass), strided, contiguous, without a negative or conjugate bit, on ``device``, of a
// dtype the kernels take (``codes``: uint8 too), writable where ``written``; with its address
// (read once: each read of it is a call into the tensor's storage) and its span.
struct Plain {
    const at::Tensor &t;
    int64_t at;
    Span span() const { return span_at(static_cast<uintptr_t>(at), t); }
};

Plain plain_on(PyObject *x, const c10::Device &device, bool codes, bool written,
               bool inference_mode) {
    if (!THPVariable_CheckExact(x)) throw Refused("not a plain tensor");
    const at::Tensor &t = THPVariable_Unpack(x);
    if (!as_stored(t) || t.device() != device ||
        (t.scalar_type() == c10::ScalarType::Byte) != codes ||
        (written && t.is_inference() && !inference_mode))
        throw Refused("not as the kernels read it");
    const auto at = static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr()));
    if (t.numel() && !at) throw Refused("no storage");
    return {t, at};
}

// A dtype group's tensors' lengths as the block maps take them (vega.codegen.triton_runtime
// .block_map): the bytes of their int64s, one object hashed and compared as one (a tuple of
// Python ints took an int made for each tensor, compared one by one, each step). The same
// lengths as one of the last few calls' give that call's object again: its hash is kept in
// it, and the block map's lookup finds its key by identity (hashing a new one took some 50
// instructions a tensor, each step). (The objects are held for the life of the process, as
// ``distinct``'s ints are, and read and replaced with the GIL held: its callers hold it.)
py::bytes lengths(const std::vector<int64_t> &numels) {
    static PyObject *last[8] = {};
    static size_t next = 0;
    const size_t size = numels.size() * sizeof(int64_t);
    for (PyObject *b : last)
        if (b != nullptr && static_cast<size_t>(PyBytes_GET_SIZE(b)) == size &&
            std::memcmp(PyBytes_AS_STRING(b), numels.data(), size) == 0)
            return py::reinterpret_borrow<py::bytes>(b);
    py::bytes made(reinterpret_cast<const char *>(numels.data()), size);
    Py_XDECREF(last[next]);
    last[next] = (Py_INCREF(made.ptr()), made.ptr());
    next = (next + 1) % 8;
    return made;
}

// A dtype group's parameters' positions among ``n``: ``range(n)`` where the group holds them
// all (one dtype group, the common case: no int made a parameter), else a list of them.
py::object positions(const std::vector<int64_t> &index, size_t n) {
    if (index.size() == n) {
        py::object all = py::reinterpret_steal<py::object>(
            PyObject_CallFunction(reinterpret_cast<PyObject *>(&PyRange_Type), "n",
                                  static_cast<Py_ssize_t>(n)));
        if (!all) throw py::error_already_set();
        return all;
    }
    py::list out(index.size());
    for (size_t r = 0; r < index.size(); r++) {
        PyObject *k = PyLong_FromLongLong(index[r]);
        if (k == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), r, k);  // (a stolen reference)
    }
    return out;
}

// What ``triton_grad_rows`` found of a step's gradients, for the same step's ``triton_rows``
// (its prelude's tables are made first): (the gradients, as a tuple that holds them; the bytes
// of int64s: the device's type and index, then each gradient's length, address and dtype).
// ``triton_rows`` takes these for its gradients where they are the same objects, in the same
// order, on its device: a gradient's length, address and dtype change only through its
// tensor (``set_``, ``.data =``), which nothing between a prelude and its step calls. The
// checks and the reads of each gradient's tensor (some 230 instructions a gradient) are not
// done twice.
struct Checked {
    const int64_t *info = nullptr;  // (null: none to take; else into the caller's bytes)

    Checked(py::handle found, PyObject *const *G, size_t n, const c10::Device &device) {
        if (found.is_none() || !PyTuple_Check(found.ptr()) || PyTuple_GET_SIZE(found.ptr()) != 2)
            return;
        PyObject *grads = PyTuple_GET_ITEM(found.ptr(), 0),
                 *bytes = PyTuple_GET_ITEM(found.ptr(), 1);
        if (!PyTuple_Check(grads) || static_cast<size_t>(PyTuple_GET_SIZE(grads)) != n ||
            !PyBytes_Check(bytes) ||
            static_cast<size_t>(PyBytes_GET_SIZE(bytes)) != (2 + 3 * n) * sizeof(int64_t))
            return;
        if (n && std::memcmp(&PyTuple_GET_ITEM(grads, 0), G, n * sizeof(PyObject *)) != 0)
            return;
        const auto *at = reinterpret_cast<const int64_t *>(PyBytes_AS_STRING(bytes));
        if (at[0] != static_cast<int64_t>(device.type()) || at[1] != device.index()) return;
        info = at + 2;
    }
};

// The rows of the address tables of a Triton step in place (vega.codegen.triton_runtime),
// grouped by dtypes, after checking every tensor as its Python path does: (key "p g s", the
// parameters' positions (``positions``), an int64 CPU tensor of rows [n, 6 + 2 * states],
// whether every address is 16-byte aligned, the parameters' lengths (``lengths``)), a group
// each; then the step counters' table (int64 [counters, 2]: each one's address twice).
// ``states``: a list of each state's tensors, state by state; ``doms``: each state's domain
// (0 the parameter's shape, 4 one number, 5 one a block of 256: 8-bit scales); ``codes``:
// whether each holds 8-bit codes (uint8), ``scales``: whether float32 only; ``checked``:
// what the step's prelude found of the gradients (``Checked``), or None. The step counter
// and hyperparameter indices: see ``indices_of``. Refused (ValueError) where any check fails
// or any two written tensors share memory; else the parameters' version counters are bumped.
py::tuple triton_rows(int64_t id, py::handle params_, py::handle grads_, py::handle states_,
                     py::handle steps_, py::handle step_index_, int64_t hyp_at,
                     int64_t hyp_width, py::handle hyper_index_,
                     const std::vector<int64_t> &doms, const std::vector<bool> &codes,
                     const std::vector<bool> &scales, const c10::Device &device,
                     py::handle checked_) {
    py::object params = py::reinterpret_steal<py::object>(PySequence_Fast(params_.ptr(), "")),
               grads = py::reinterpret_steal<py::object>(PySequence_Fast(grads_.ptr(), "")),
               states = py::reinterpret_steal<py::object>(PySequence_Fast(states_.ptr(), "")),
               steps = py::reinterpret_steal<py::object>(PySequence_Fast(steps_.ptr(), ""));
    if (!params || !grads || !states || !steps) throw py::error_already_set();
    const size_t n = PySequence_Fast_GET_SIZE(params.ptr()), ns = doms.size(),
                 nt = PySequence_Fast_GET_SIZE(steps.ptr());
    // (the per-tensor index lists read by ``ints_of``: pybind11's conversion took ~30 ns an
    // item; the common ones made here, ``indices_of``)
    const std::vector<int64_t> step_index = indices_of(step_index_, n, "step index"),
                               hyper_index = indices_of(hyper_index_, n, "hyperparameter index");
    if (static_cast<size_t>(PySequence_Fast_GET_SIZE(grads.ptr())) != n ||
        static_cast<size_t>(PySequence_Fast_GET_SIZE(states.ptr())) != ns ||
        step_index.size() != n || hyper_index.size() != n || codes.size() != ns ||
        scales.size() != ns)
        throw Refused("the lists of a step do not match");
    // each state's column (its tensors, a parameter each), read as the lists it holds
    std::vector<py::object> columns(ns);
    std::vector<PyObject **> S(ns);
    for (size_t s = 0; s < ns; s++) {
        columns[s] = py::reinterpret_steal<py::object>(
            PySequence_Fast(PySequence_Fast_GET_ITEM(states.ptr(), s), ""));
        if (!columns[s]) throw py::error_already_set();
        if (static_cast<size_t>(PySequence_Fast_GET_SIZE(columns[s].ptr())) != n)
            throw Refused("the lists of a step do not match");
        S[s] = PySequence_Fast_ITEMS(columns[s].ptr());
    }
    PyObject **P = PySequence_Fast_ITEMS(params.ptr()), **G = PySequence_Fast_ITEMS(grads.ptr()),
             **T = PySequence_Fast_ITEMS(steps.ptr());
    const bool inference_mode = c10::InferenceMode::is_enabled();
    const Checked checked(checked_, G, n, device);  // (the prelude's, where it serves)
    std::vector<Span> spans, reads;
    spans.reserve(n * (ns + 1) + nt);
    reads.reserve(n);
    std::vector<int64_t> step_at(nt);
    for (size_t j = 0; j < nt; j++) {
        prefetch_objects(T, nt, j);
        if (!THPVariable_CheckExact(T[j])) throw Refused("a step counter is not a plain tensor");
        const at::Tensor &t = THPVariable_Unpack(T[j]);
        if (!is_counter(t, device) || !t.data_ptr() || (t.is_inference() && !inference_mode))
            throw Refused("a step counter is not a 0-d int32 tensor on the device");
        step_at[j] = reinterpret_cast<intptr_t>(t.data_ptr());
        spans.push_back(span_of(t));
    }
    const int64_t width = 6 + 2 * static_cast<int64_t>(ns);  // the columns: see below
    struct Found {
        std::vector<int64_t> rows, index, numels;
        uint64_t code;
        std::string key;
        int64_t any_address = 0;
    };
    std::vector<Found> groups;
    std::vector<const at::Tensor *> st(ns);
    std::vector<int64_t> st_at(ns);
    for (size_t i = 0; i < n; i++) {
        prefetch_objects(P, n, i);
        if (!checked.info) prefetch_objects(G, n, i);
        for (size_t s = 0; s < ns; s++) prefetch_objects(S[s], n, i);
        const Plain pp = plain_on(P[i], device, false, true, inference_mode);
        const at::Tensor &p = pp.t;
        int64_t g_numel, g_at;
        c10::ScalarType g_type;
        if (checked.info) {
            const int64_t *found = checked.info + 3 * i;
            g_numel = found[0], g_at = found[1];
            g_type = static_cast<c10::ScalarType>(found[2]);
        } else {
            const Plain gg = plain_on(G[i], device, false, false, inference_mode);
            g_numel = gg.t.numel(), g_at = gg.at, g_type = gg.t.scalar_type();
        }
        if (g_numel != p.numel()) throw Refused("a gradient's length differs");
        spans.push_back(pp.span());
        reads.push_back({static_cast<uintptr_t>(g_at), static_cast<uintptr_t>(g_at) +
                         static_cast<uintptr_t>(g_numel) * c10::elementSize(g_type)});
        for (size_t s = 0; s < ns; s++) {
            const Plain xx = plain_on(S[s][i], device, codes[s], true, inference_mode);
            const at::Tensor &x = xx.t;
            if (scales[s] && x.scalar_type() != c10::ScalarType::Float)
                throw Refused("8-bit scales not float32");
            if (!state_fits(x, p, doms[s], nullptr)) throw Refused("a state's shape");
            st[s] = &x;
            st_at[s] = xx.at;
            spans.push_back(xx.span());
        }
        if (step_index[i] < 0 || static_cast<size_t>(step_index[i]) >= nt || hyper_index[i] < 0)
            throw Refused("an index is out of range");
        const Pointed one{st};  // (this parameter's states, as a list of one parameter's)
        const uint64_t code = dtype_code(p, g_type, one, 0, 1, ns);
        auto key = [&] { return dtype_key(p, THPVariable_Unpack(G[i]), one, 0, 1, ns); };
        std::string named;
        Found *grp = found_group(groups, code, key, named);
        if (grp == nullptr) {  // (room for the rest: one group holds every parameter, as a
            groups.emplace_back();  // rule's usually does, and grows none of its vectors)
            grp = &groups.back();
            grp->code = code;
            grp->key = named.empty() ? key() : named;
            grp->rows.reserve((n - i) * static_cast<size_t>(width));
            grp->index.reserve(n - i);
            grp->numels.reserve(n - i);
        }
        const size_t at = grp->rows.size();
        grp->rows.resize(at + width);
        int64_t *row = grp->rows.data() + at;
        // numel, p, g, each state, the step counter, the hyperparameter row, then where p
        // and each state are written: themselves (vega.codegen.triton_runtime._step_impl)
        row[0] = p.numel();
        row[1] = row[5 + ns] = pp.at;
        row[2] = g_at;
        for (size_t s = 0; s < ns; s++) row[3 + s] = row[6 + ns + s] = st_at[s];
        row[3 + ns] = step_at[step_index[i]];
        row[4 + ns] = hyp_at + hyper_index[i] * hyp_width;
        grp->any_address |= row[1] | row[2];
        for (size_t s = 0; s < ns; s++) grp->any_address |= row[3 + s];
        grp->index.push_back(static_cast<int64_t>(i));
        grp->numels.push_back(p.numel());
    }
    if (any_shared(spans, reads))
        throw Refused("two tensors a step writes share memory, or a gradient shares memory "
                      "with one");
    // the parameters' version counters, as an in-place torch operation bumps them (autograd
    // then refuses a graph that saved one of them): the step is taken from here on
    for (size_t i = 0; i < n; i++)
        bump_ahead(n, i, [&](size_t k) -> const at::Tensor & { return THPVariable_Unpack(P[k]); });
    py::list out;
    for (Found &f : groups) {
        const int64_t rows = static_cast<int64_t>(f.index.size());
        at::Tensor table = at::empty({rows, width}, at::TensorOptions().dtype(at::kLong));
        std::memcpy(table.data_ptr(), f.rows.data(), f.rows.size() * sizeof(int64_t));
        out.append(py::make_tuple(f.key, positions(f.index, n), table, f.any_address % 16 == 0,
                                  lengths(f.numels)));
    }
    // the step counters' table: each counter's address, read and written (in place: twice)
    at::Tensor counters = at::empty({static_cast<int64_t>(nt), 2},
                                    at::TensorOptions().dtype(at::kLong));
    int64_t *c = counters.data_ptr<int64_t>();
    for (size_t j = 0; j < nt; j++) c[2 * j] = c[2 * j + 1] = step_at[j];
    return py::make_tuple(out, counters);
}

// The prelude's tables of a Triton step (vega.codegen.triton_runtime): the gradients grouped
// by dtype, each plain on ``device`` as ``plain_on`` checks (else Refused), as (dtype name, an
// int64 [n, 2] CPU tensor of rows (length, address), the lengths as ``lengths`` gives them),
// a group each; and what it found of them, for the step's ``triton_rows`` (``Checked``).
py::tuple triton_grad_rows(py::handle grads_, const c10::Device &device) {
    py::tuple grads = py::reinterpret_steal<py::tuple>(PySequence_Tuple(grads_.ptr()));
    if (!grads) throw py::error_already_set();
    const size_t n = PyTuple_GET_SIZE(grads.ptr());
    PyObject **G = &PyTuple_GET_ITEM(grads.ptr(), 0);
    std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> groups;  // rows by dtype
    std::vector<int64_t> info(2 + 3 * n);  // (``Checked``)
    info[0] = static_cast<int64_t>(device.type());
    info[1] = device.index();
    for (size_t i = 0; i < n; i++) {
        prefetch_objects(G, n, i);
        const Plain gg = plain_on(G[i], device, false, false, true);
        const at::Tensor &g = gg.t;
        info[2 + 3 * i] = g.numel();
        info[3 + 3 * i] = gg.at;
        info[4 + 3 * i] = static_cast<int64_t>(g.scalar_type());
        std::vector<int64_t> *rows = nullptr;
        for (auto &grp : groups)
            if (grp.first == g.scalar_type()) rows = &grp.second;
        if (rows == nullptr) {
            groups.emplace_back(g.scalar_type(), std::vector<int64_t>());
            rows = &groups.back().second;
        }
        rows->push_back(g.numel());
        rows->push_back(gg.at);
    }
    py::list out;
    for (auto &grp : groups) {
        const int64_t count = static_cast<int64_t>(grp.second.size() / 2);
        at::Tensor table = at::empty({count, 2}, at::TensorOptions().dtype(at::kLong));
        std::memcpy(table.data_ptr(), grp.second.data(), grp.second.size() * sizeof(int64_t));
        std::vector<int64_t> numels(static_cast<size_t>(count));
        for (int64_t r = 0; r < count; r++) numels[r] = grp.second[2 * r];
        out.append(py::make_tuple(dtype_name(grp.first), table, lengths(numels)));
    }
    return py::make_tuple(out, py::make_tuple(grads, py::bytes(
        reinterpret_cast<const char *>(info.data()), info.size() * sizeof(int64_t))));
}

// -- gathering a class step's tensors (vega.codegen.c.native.gather) ---------------------

// Whether ``x`` is an object of exactly one of the types of the tuple ``plain``.
bool of_types(PyObject *x, PyObject *plain) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(plain); k++)
        if (Py_TYPE(x) == reinterpret_cast<PyTypeObject *>(PyTuple_GET_ITEM(plain, k)))
            return true;
    return false;
}

// What a class step reads of a group in one pass (``vega.runtime.optimizer``): each
// parameter's gradient, as ``p.grad`` reads it (the Python object torch keeps for it, or
// None), and for each name of ``names`` the list of ``st[name]`` over the state dicts
// ``sts``. With ``flags``: 1, some gradient is None; 2, some gradient or state tensor is
// not exactly of a type of ``plain`` (a tensor subclass: the caller then asks which);
// 4, some gradient is not strided (sparse). None where a parameter is not exactly of a type
// of ``plain`` or a state is not exactly a dict (a subclass may read its items its own way:
// the caller's Python path reads those); KeyError where a state dict lacks a name. The
// sequences are read as tuples of them: what it makes may run the garbage collector, and a
// finalizer could change a list.
py::object gather(py::handle params_, py::handle sts_, py::handle names_, py::handle plain_) {
    const py::tuple params = tuple_of(params_, "gather: params"),
                    sts = tuple_of(sts_, "gather: state dicts"),
                    names = tuple_of(names_, "gather: names");
    PyObject *plain = plain_.ptr();
    if (!PyTuple_Check(plain)) throw py::type_error("gather: plain must be a tuple of types");
    const Py_ssize_t n = PyTuple_GET_SIZE(params.ptr()), nn = PyTuple_GET_SIZE(names.ptr());
    if (PyTuple_GET_SIZE(sts.ptr()) != n)
        throw py::value_error("gather: one state dict a parameter");
    PyObject **P = &PyTuple_GET_ITEM(params.ptr(), 0), **S = &PyTuple_GET_ITEM(sts.ptr(), 0),
             **N = &PyTuple_GET_ITEM(names.ptr(), 0);
    int64_t flags = 0;
    py::list grads(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + 2 * PREFETCH_AHEAD < n) {
            __builtin_prefetch(P[i + 2 * PREFETCH_AHEAD]);
            __builtin_prefetch(S[i + 2 * PREFETCH_AHEAD]);
        }
        // (p.grad reads the parameter's tensor, then its autograd metadata, then the gradient's
        // tensor: each asked for nearer than the link before, once that link has come; the
        // gradient's through the tensor's own public grad(), which, unlike Tensor::grad(), does not
        // warn of a tensor that is not a leaf. With these, gather over the 1,000 tensors of the
        // many-small set after torch's fused step: 259-268 us, against 310-344 before)
        if (i + PREFETCH_AHEAD < n && THPVariable_CheckExact(P[i + PREFETCH_AHEAD]))
            prefetch_tensor(THPVariable_Unpack(P[i + PREFETCH_AHEAD]));
        if (i + PREFETCH_AHEAD / 2 < n && THPVariable_CheckExact(P[i + PREFETCH_AHEAD / 2]))
            __builtin_prefetch(THPVariable_Unpack(P[i + PREFETCH_AHEAD / 2])
                                   .unsafeGetTensorImpl()->autograd_meta());
        if (i + PREFETCH_AHEAD / 4 < n && THPVariable_CheckExact(P[i + PREFETCH_AHEAD / 4])) {
            const at::Tensor &ahead =
                THPVariable_Unpack(P[i + PREFETCH_AHEAD / 4]).unsafeGetTensorImpl()->grad();
            if (ahead.defined()) prefetch_tensor(ahead);
        }
        if (!of_types(P[i], plain)) return py::none();
        const at::Tensor &g = THPVariable_Unpack(P[i]).grad();
        if (!g.defined()) {
            flags |= 1;
            PyList_SET_ITEM(grads.ptr(), i, (Py_INCREF(Py_None), Py_None));
            continue;
        }
        PyObject *obj = THPVariable_Wrap(g);
        if (obj == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(grads.ptr(), i, obj);
        if (!of_types(obj, plain)) flags |= 2;
        if (g.layout() != c10::kStrided) flags |= 4;
    }
    py::list cols(nn);
    std::vector<PyObject *> col(static_cast<size_t>(nn));
    for (Py_ssize_t k = 0; k < nn; k++) {
        col[k] = PyList_New(n);
        if (col[k] == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(cols.ptr(), k, col[k]);  // (a stolen reference)
    }
    auto put = [&](Py_ssize_t k, Py_ssize_t i, PyObject *x) {  // (x borrowed)
        if (!of_types(x, plain)) flags |= 2;
        PyList_SET_ITEM(col[k], i, (Py_INCREF(x), x));
    };
    // A state dict's entries read in order while its keys are ``names`` themselves, in order
    // (a class's state dicts are made so): a pointer compared an entry, where a lookup hashed
    // and probed (~110 instructions a name). From the first other key on, looked up.
    for (Py_ssize_t i = 0; i < n && nn; i++) {  // (no names: no state dict read, as before)
        // (the dict, then its table of entries, then the values its first entries hold)
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(S[i + PREFETCH_AHEAD]);
        if (i + PREFETCH_AHEAD / 2 < n && PyDict_CheckExact(S[i + PREFETCH_AHEAD / 2]))
            prefetch_lines(reinterpret_cast<PyDictObject *>(S[i + PREFETCH_AHEAD / 2])->ma_keys,
                           128);
        if (i + PREFETCH_AHEAD / 4 < n && PyDict_CheckExact(S[i + PREFETCH_AHEAD / 4])) {
            Py_ssize_t pos = 0, k = 0;
            PyObject *key, *value;
            while (k++ < nn && PyDict_Next(S[i + PREFETCH_AHEAD / 4], &pos, &key, &value))
                __builtin_prefetch(value, 1);
        }
        if (!PyDict_CheckExact(S[i])) return py::none();
        Py_ssize_t k = 0, pos = 0;
        PyObject *key, *value;
        while (k < nn && PyDict_Next(S[i], &pos, &key, &value) && key == N[k]) put(k++, i, value);
        for (; k < nn; k++) {
            PyObject *x = PyDict_GetItemWithError(S[i], N[k]);
            if (x == nullptr) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, N[k]);
                throw py::error_already_set();
            }
            put(k, i, x);
        }
    }
    return py::make_tuple(grads, cols, flags);
}

// ``vega.codegen.base.distinct`` of a sequence of objects: (the distinct ones by identity,
// in the order they first appear; each item's position among them). An open-addressing
// table of the objects' addresses, and the positions as Python ints made once (~20 ns an
// item, where std::unordered_map's nodes and new ints took ~110 ns).
py::tuple distinct(py::handle items_) {
    const py::tuple items = tuple_of(items_, "distinct: items");
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    PyObject **X = &PyTuple_GET_ITEM(items.ptr(), 0);
    // 0, 1, 2, ...: the first 2^16 made once and held for the process (the GIL held)
    static std::vector<PyObject *> ints;
    while (static_cast<Py_ssize_t>(ints.size()) < std::min<Py_ssize_t>(n, 1 << 16)) {
        PyObject *k = PyLong_FromSsize_t(static_cast<Py_ssize_t>(ints.size()));
        if (k == nullptr) throw py::error_already_set();
        ints.push_back(k);
    }
    Py_ssize_t first = 1;  // all one object (a group's hyperparameters): no table
    while (first < n && X[first] == X[0]) first++;
    if (n && first == n) {
        py::list one(1), index(n);
        Py_INCREF(X[0]);
        PyList_SET_ITEM(one.ptr(), 0, X[0]);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(ints[0]);
            PyList_SET_ITEM(index.ptr(), i, ints[0]);
        }
        return py::make_tuple(one, index);
    }
    size_t size = 16;
    while (size < 2 * static_cast<size_t>(n)) size *= 2;
    std::vector<PyObject *> keys(size, nullptr);
    std::vector<Py_ssize_t> at(size), pos(static_cast<size_t>(n));
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t h = (reinterpret_cast<uintptr_t>(X[i]) >> 4) * 0x9E3779B97F4A7C15ull;
        size_t slot = (h >> 20) & (size - 1);
        while (keys[slot] != nullptr && keys[slot] != X[i]) slot = (slot + 1) & (size - 1);
        if (keys[slot] == nullptr) {
            keys[slot] = X[i];
            at[slot] = count++;
        }
        pos[static_cast<size_t>(i)] = at[slot];
    }
    if (count == n) {  // all distinct (each parameter its own counter): the items, in order,
        // and ``range(n)``, which makes no int an item
        py::object all = py::reinterpret_steal<py::object>(
            PyObject_CallFunction(reinterpret_cast<PyObject *>(&PyRange_Type), "n", n));
        if (!all) throw py::error_already_set();
        py::object uniq = py::reinterpret_steal<py::object>(PySequence_List(items.ptr()));
        if (!uniq) throw py::error_already_set();
        return py::make_tuple(uniq, all);
    }
    py::list uniq(count), index(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t j = pos[static_cast<size_t>(i)];
        PyObject *k = j < (1 << 16) ? ints[static_cast<size_t>(j)] : PyLong_FromSsize_t(j);
        if (k == nullptr) throw py::error_already_set();
        if (j < (1 << 16)) Py_INCREF(k);
        PyList_SET_ITEM(index.ptr(), i, k);
        if (PyList_GET_ITEM(uniq.ptr(), j) == nullptr)  // (its first place)
            PyList_SET_ITEM(uniq.ptr(), j, (Py_INCREF(X[i]), X[i]));
    }
    return py::make_tuple(uniq, index);
}

// A list or tuple as it is, else a tuple of the sequence's items (``tuple_of``: its iteration
// may run Python code). Its items are read with ``PySequence_Fast_ITEMS`` only once nothing
// more can run Python code: a list is read in place, not copied (the copy and its references
// cost more than a compare of addresses).
py::object held_items(py::handle seq, const char *what) {
    return PyList_CheckExact(seq.ptr()) || PyTuple_CheckExact(seq.ptr())
               ? py::reinterpret_borrow<py::object>(seq)
               : py::object(tuple_of(seq, what));
}

// Whether sequences ``a`` and ``b`` hold the same objects in the same order (by identity).
// (Both are held before either's items are read: iterating ``b`` could change list ``a``.)
bool same(py::handle a_, py::handle b_) {
    const py::object a = held_items(a_, "same: a"), b = held_items(b_, "same: b");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(a.ptr());
    return n == PySequence_Fast_GET_SIZE(b.ptr()) &&
           (n == 0 || std::memcmp(PySequence_Fast_ITEMS(a.ptr()), PySequence_Fast_ITEMS(b.ptr()),
                                  n * sizeof(PyObject *)) == 0);
}

// Whether ``pred`` holds for some (``any``) or for every tensor of a sequence; None where an
// item is not exactly of a type of ``plain`` (the caller asks in Python).
template <typename Pred>
py::object over_plain(py::handle items_, py::handle plain_, const std::string &what, bool any,
                      Pred pred) {
    const py::tuple items = tuple_of(items_, (what + ": tensors").c_str());
    if (!PyTuple_Check(plain_.ptr())) throw py::type_error(what + ": plain: a tuple");
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    PyObject **X = &PyTuple_GET_ITEM(items.ptr(), 0);
    bool found = !any;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_objects(X, static_cast<size_t>(n), static_cast<size_t>(i));
        if (!of_types(X[i], plain_.ptr())) return py::none();
        const bool holds = pred(THPVariable_Unpack(X[i]));
        found = any ? found || holds : found && holds;
    }
    return py::bool_(found);
}

// Whether some tensor of a sequence is complex (None: see ``over_plain``).
py::object any_complex(py::handle items_, py::handle plain_) {
    return over_plain(items_, plain_, "any_complex", true,
                      [](const at::Tensor &t) { return t.is_complex(); });
}

// Whether every item is a dense real tensor (strided, not nested, not complex) exactly of a
// type of ``plain``, on the first one's device: what a fused step's prelude asks of its
// gradients, in one pass (False says nothing of what differs: the caller's checks say it).
bool uniform(py::handle items_, py::handle plain_) {
    c10::optional<c10::Device> first;
    const py::object found = over_plain(items_, plain_, "uniform", false, [&](const at::Tensor &x) {
        if (!first) first = x.device();
        return !x.is_nested() && x.layout() == c10::kStrided && !x.is_complex() &&
               x.device() == *first;
    });
    return !found.is_none() && found.cast<bool>();
}

// Whether every item is a floating-point tensor, complex ones not (None: see ``over_plain``).
py::object floats(py::handle items_, py::handle plain_) {
    return over_plain(items_, plain_, "floats", false,
                      [](const at::Tensor &t) { return t.is_floating_point(); });
}

// Whether every ``refs[i]`` is on the device of ``refs[0]`` and ``items[i]`` is, for every i,
// a strided tensor exactly of a type of ``plain``, of the shape of ``refs[i]``, on that
// device, and complex where ``refs[i]`` is (the quick check of a functional step's
// parameters, gradients and states: False sends the caller to its checks tensor by tensor,
// which say what is wrong). ``refs`` are tensors.
bool like(py::handle refs_, py::handle items_, py::handle plain_) {
    const py::tuple refs = tuple_of(refs_, "like: refs"), items = tuple_of(items_, "like: items");
    if (!PyTuple_Check(plain_.ptr())) throw py::type_error("like: plain: a tuple");
    const Py_ssize_t n = PyTuple_GET_SIZE(refs.ptr());
    if (PyTuple_GET_SIZE(items.ptr()) != n) return false;
    PyObject **R = &PyTuple_GET_ITEM(refs.ptr(), 0), **X = &PyTuple_GET_ITEM(items.ptr(), 0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!THPVariable_Check(R[i])) throw py::type_error("like: refs must be tensors");
    if (n == 0) return true;
    const c10::Device device = THPVariable_Unpack(R[0]).device();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!of_types(X[i], plain_.ptr())) return false;
        const at::Tensor &x = THPVariable_Unpack(X[i]), &r = THPVariable_Unpack(R[i]);
        if (x.is_nested() || r.is_nested() || x.layout() != c10::kStrided ||
            r.layout() != c10::kStrided || x.device() != device || r.device() != device ||
            x.is_complex() != r.is_complex() || x.sizes() != r.sizes())
            return false;
    }
    return true;
}

// Whether every ``items[i]`` is a strided tensor exactly of a type of ``plain``, on the device
// of ``refs[i]``, that a kernel takes as a state of its parameter ``refs[i]``: of its shape
// (``dom`` 0), one number (4) or one a block of 256 of its elements (5, an 8-bit state's
// scales), of a dtype the compiled kernels take (``want`` 0: float32, float64, bfloat16 or
// float16), 8-bit codes (1: uint8), float32 scales (2) or step counters (3: int32).
// The quick check of a class step's states before its first call writes (False sends the
// caller to its checks tensor by tensor, which say what is wrong; other domains: False).
bool fit(py::handle refs_, py::handle items_, py::handle plain_, int64_t dom, int64_t want) {
    const py::tuple refs = tuple_of(refs_, "fit: refs"), items = tuple_of(items_, "fit: items");
    if (!PyTuple_Check(plain_.ptr())) throw py::type_error("fit: plain: a tuple");
    const Py_ssize_t n = PyTuple_GET_SIZE(refs.ptr());
    if (PyTuple_GET_SIZE(items.ptr()) != n || (dom != 0 && dom != 4 && dom != 5)) return false;
    PyObject **R = &PyTuple_GET_ITEM(refs.ptr(), 0), **X = &PyTuple_GET_ITEM(items.ptr(), 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_objects(X, static_cast<size_t>(n), static_cast<size_t>(i));
        if (!THPVariable_Check(R[i])) throw py::type_error("fit: refs must be tensors");
        if (!of_types(X[i], plain_.ptr())) return false;
        const at::Tensor &x = THPVariable_Unpack(X[i]), &r = THPVariable_Unpack(R[i]);
        if (x.is_nested() || r.is_nested() || x.layout() != c10::kStrided ||
            x.device() != r.device())
            return false;
        const bool shaped = state_fits(x, r, dom, nullptr);
        const c10::ScalarType t = x.scalar_type();
        const bool typed = want == 0 ? t == c10::ScalarType::Float ||
                                           t == c10::ScalarType::Double ||
                                           t == c10::ScalarType::BFloat16 ||
                                           t == c10::ScalarType::Half
                         : want == 1 ? t == c10::ScalarType::Byte
                         : want == 2 ? t == c10::ScalarType::Float
                                     : t == c10::ScalarType::Int;
        if (!shaped || !typed) return false;
    }
    return true;
}

PYBIND11_MODULE(vega_native, m) {
    py::register_exception<MissingLibrary>(m, "MissingLibrary", PyExc_LookupError);
    m.def("add_kernel", [](int64_t id, std::string name, int64_t nstates, int64_t nphases,
                           int64_t nred, int64_t nhyper, bool axes, std::vector<int64_t> doms,
                           std::vector<int64_t> columns, std::vector<int64_t> wants) {
        if (static_cast<int64_t>(doms.size()) != nstates || columns.size() != 10 ||
            static_cast<int64_t>(wants.size()) != nstates)
            fail("add_kernel: one domain and one dtype a state, and ten column starts");
        auto k = std::make_shared<Kernel>();
        k->col = {columns[0], columns[1], columns[2], columns[3], columns[4],
                  columns[5], columns[6], columns[7], columns[8], columns[9]};
        k->name = std::move(name);
        k->nstates = nstates, k->nphases = nphases, k->nred = nred, k->nhyper = nhyper;
        k->axes = axes;
        k->doms = std::move(doms);
        k->wants = std::move(wants);
        std::lock_guard<std::mutex> guard(registry_lock);
        registry[id] = k;
    });
    m.def("add_library", [](int64_t id, std::string key, int64_t prelude, int64_t advance,
                            int64_t update, int64_t fused, int64_t axes_step,
                            std::vector<int64_t> phases) {
        auto lib = std::make_shared<Library>();
        lib->prelude = reinterpret_cast<PreludeEntry>(prelude);
        lib->advance = reinterpret_cast<AdvanceEntry>(advance);
        lib->update = reinterpret_cast<Entry>(update);
        lib->fused = reinterpret_cast<Entry>(fused);
        lib->axes_step = reinterpret_cast<AxesEntry>(axes_step);
        for (int64_t f : phases) lib->phases.push_back(reinterpret_cast<Entry>(f));
        auto k = kernel_of(id);
        std::lock_guard<std::mutex> guard(registry_lock);
        k->libs[key] = lib;
    });
    m.def("entry_calls", []() { return entry_calls.load(); });
    m.attr("APART_ELEMENTS") = APART_ELEMENTS;  // (the kernels' PAR_MIN: a test holds them equal)
    m.def("drop_kernel", [](int64_t id) {
        std::lock_guard<std::mutex> guard(registry_lock);
        registry.erase(id);
    });
    // the eager calls: the arguments converted with the GIL held, the work done without it.
    // A step in place then advances the parameters' version counters, as an in-place torch
    // operation does (torch.autograd.graph.increment_version's rule: an inference tensor has
    // none), so that autograd refuses a graph that saved their old values (``step_impl``'s
    // ``bump``).
    m.def("step", [](int64_t id, py::handle params, py::handle grads, py::handle states,
                     py::handle steps, py::handle step_index, py::handle hypers,
                     py::handle hyper_index, const c10::optional<at::Tensor> &pre,
                     py::handle geometry, py::handle outs) {
        EagerArgs(params, grads, states, steps, step_index, hypers, hyper_index, geometry, outs)
            .run(id, pre, true, nullptr);
    });
    // A staged step's tables (vega.codegen.c.launch.Kernel._staged_tables: its kernels run
    // phase by phase, their reductions over the group combined between): the step's every
    // check, in place, and its rows, built as for ``step`` (none of its tensors written, no
    // version advanced): [(the dtype group's "p g s" key, its rows as an int64 tensor, its
    // parameters' positions)].
    m.def("tables", [](int64_t id, py::handle params, py::handle grads, py::handle states,
                       py::handle steps, py::handle step_index, py::handle hypers,
                       py::handle hyper_index, py::handle geometry) {
        const EagerArgs args(params, grads, states, steps, step_index, hypers, hyper_index,
                             geometry, py::tuple());
        std::vector<Group> groups;
        args.run(id, c10::nullopt, false, &groups);
        const int64_t width = kernel_of(id)->col.width;
        py::list out;
        for (const Group &grp : groups) {
            at::Tensor rows = at::empty({grp.n, width}, at::kLong);
            std::memcpy(rows.data_ptr<int64_t>(), grp.rows.data(),
                        grp.rows.size() * sizeof(int64_t));
            out.append(py::make_tuple(grp.key, rows, positions(grp.at, args.p.ts.size())));
        }
        return out;
    });
    // whether a step in place may write every one of these tensors: none an inference
    // tensor outside inference mode, each contiguous, no two sharing memory, and none sharing
    // memory with one of ``reads`` (the gradients) (False where one is not contiguous:
    // vega.codegen.tensors.inplace_problem then reads it in Python)
    m.def("writable", [](py::handle seq, py::handle read) {
        const Held tensors = tensors_of(seq, "tensor");
        const bool inference_mode = c10::InferenceMode::is_enabled();
        std::vector<Span> spans, reads;
        spans.reserve(tensors.ts.size());
        for (const at::Tensor *pt : tensors.ts) {
            const at::Tensor &t = *pt;
            if (!t.defined() || t.layout() != c10::kStrided || !t.is_contiguous() ||
                (t.is_inference() && !inference_mode) || (t.numel() && !t.data_ptr()))
                return false;
            spans.push_back(span_of(t));
        }
        if (!read.is_none()) {  // (tensors a step reads: each contiguous, else False)
            const Held readable = tensors_of(read, "tensor");
            reads.reserve(readable.ts.size());
            for (const at::Tensor *pt : readable.ts) {
                const at::Tensor &t = *pt;
                if (!t.defined()) continue;  // (None: nothing read)
                if (t.layout() != c10::kStrided || !t.is_contiguous() ||
                    (t.numel() && !t.data_ptr()))
                    return false;
                reads.push_back(span_of(t));
            }
        }
        return !any_shared(spans, reads);
    }, py::arg("tensors"), py::arg("reads") = py::none());
    py::register_exception<Refused>(m, "Refused", PyExc_ValueError);
    m.def("triton_rows", &triton_rows);
    m.def("gather", &gather);
    m.def("distinct", &distinct);
    m.def("same", &same);
    m.def("any_complex", &any_complex);
    m.def("uniform", &uniform);
    m.def("floats", &floats);
    m.def("like", &like);
    m.def("fit", &fit);
    m.def("triton_grad_rows", &triton_grad_rows);
    m.def("prelude", [](int64_t id, py::handle grads, const at::Tensor &pre) {
        const auto g = tensors_of(grads, "gradient");
        py::gil_scoped_release unlocked;
        prelude_impl(id, g.list(), pre);
    });
}
