// vega's tensor scanner: what the C backend reads of each tensor before a step (its address,
// element count, dtype and layout, and its parameter's gradient), for a list of tensors in
// one call, instead of five or six Python calls a tensor.
//
// It reads a tensor's TensorImpl through the pointer a torch.Tensor object holds right after
// its Python object header. vega.codegen.native checks that layout on real tensors (against
// Tensor._cdata) before it loads this module, and never uses it where the check fails.
#include <Python.h>
#include <c10/core/TensorImpl.h>
#include <ATen/core/TensorBase.h>

#include <cstdint>
#include <vector>

namespace {

PyTypeObject *tensor_type = nullptr;  // torch.Tensor, set by init()
Py_ssize_t impl_offset = 0;           // where a tensor object holds its TensorImpl *

// flags: the ScalarType in the low byte, and these bits: RESOLVED, neither the negative nor
// the conjugate bit set (a kernel reads the values as stored); INFERENCE, made under
// torch.inference_mode()
constexpr int64_t DEFINED = 1 << 8, STRIDED = 1 << 9, CONTIGUOUS = 1 << 10, CPU = 1 << 11,
                  RESOLVED = 1 << 12, INFERENCE = 1 << 13;

// (address, numel, flags) of one tensor; a tensor that is not a strided tensor with storage
// (sparse, a wrapper subclass, meta) is DEFINED alone, and any error of torch's leaves it so.
void describe(const c10::TensorImpl *t, int64_t *out) {
    out[0] = out[1] = out[2] = 0;
    if (t == nullptr) return;
    out[2] = DEFINED;
    try {
        if (t->layout() != c10::kStrided || !t->has_storage() || !t->storage_initialized())
            return;
        int64_t flags = DEFINED | STRIDED | (int64_t)(uint8_t)c10::typeMetaToScalarType(t->dtype());
        if (t->is_contiguous()) flags |= CONTIGUOUS;
        if (t->device_type() == c10::DeviceType::CPU) flags |= CPU;
        if (!t->is_neg() && !t->is_conj()) flags |= RESOLVED;
        if (const_cast<c10::TensorImpl *>(t)->is_inference()) flags |= INFERENCE;
        out[0] = (int64_t)(intptr_t)t->data();
        out[1] = t->numel();
        out[2] = flags;
    } catch (...) {
        out[0] = out[1] = 0;
        out[2] = DEFINED;
    }
}

const c10::TensorImpl *impl_of(PyObject *obj) {
    return *reinterpret_cast<c10::TensorImpl *const *>(reinterpret_cast<char *>(obj) +
                                                       impl_offset);
}

PyObject *init(PyObject *, PyObject *args) {
    PyObject *type;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "O!n", &PyType_Type, &type, &offset)) return nullptr;
    Py_INCREF(type);
    tensor_type = reinterpret_cast<PyTypeObject *>(type);
    impl_offset = offset;
    Py_RETURN_NONE;
}

// The gradients a scan found, each held (a reference to its TensorImpl) until this capsule
// is freed: a kernel that reads them runs without the GIL, while another thread may drop
// them (zero_grad).
const char *HELD = "vega_native.held";

void release(PyObject *capsule) {
    auto *held = static_cast<std::vector<c10::TensorImpl *> *>(
        PyCapsule_GetPointer(capsule, HELD));
    for (c10::TensorImpl *g : *held) c10::raw::intrusive_ptr::decref(g);
    delete held;
}

// scan(tensors, address, grads): for each item of the list ``tensors`` (a tensor or None),
// three int64 at ``address`` (address, numel, flags; zeros for None); with ``grads`` true,
// three more for the tensor's .grad (zeros where it has none), and the result is a capsule
// holding those gradients (else None).
PyObject *scan(PyObject *, PyObject *args) {
    PyObject *list;
    unsigned long long address;
    int grads;
    if (!PyArg_ParseTuple(args, "O!Kp", &PyList_Type, &list, &address, &grads)) return nullptr;
    if (tensor_type == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "vega native scanner: init() was not called");
        return nullptr;
    }
    int64_t *out = reinterpret_cast<int64_t *>(static_cast<uintptr_t>(address));
    const Py_ssize_t n = PyList_GET_SIZE(list), width = grads ? 6 : 3;
    auto *held = grads ? new std::vector<c10::TensorImpl *>() : nullptr;
    PyObject *result = Py_None;
    if (held) {
        held->reserve(n);
        result = PyCapsule_New(held, HELD, release);
        if (result == nullptr) {
            delete held;
            return nullptr;
        }
    } else {
        Py_INCREF(result);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyList_GET_ITEM(list, i);
        int64_t *row = out + i * width;
        if (obj == Py_None) {
            for (Py_ssize_t k = 0; k < width; k++) row[k] = 0;
            continue;
        }
        if (!PyObject_TypeCheck(obj, tensor_type)) {
            PyErr_Format(PyExc_TypeError, "vega native scanner: item %zd is of type %s, not "
                         "a tensor", i, Py_TYPE(obj)->tp_name);
            Py_DECREF(result);
            return nullptr;
        }
        const c10::TensorImpl *t = impl_of(obj);
        describe(t, row);
        if (grads && t != nullptr) {
            c10::TensorImpl *g = nullptr;
            try {
                const at::TensorBase &grad =
                    reinterpret_cast<const at::TensorBase &>(t->grad());
                g = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
            } catch (...) {
                g = nullptr;
                row[2] &= ~STRIDED;  // a parameter whose gradient torch will not show us
            }
            if (g != nullptr) {
                c10::raw::intrusive_ptr::incref(g);
                held->push_back(g);
            }
            describe(g, row + 3);
        } else if (grads) {
            for (Py_ssize_t k = 3; k < 6; k++) row[k] = 0;
        }
    }
    return result;
}

// same_items(dicts, names, expected): whether dicts[i][names[k]] is expected[k * n + i] for
// every dict i (of n) and name k (a missing key, or a dicts[i] that is not a dict: false).
PyObject *same_items(PyObject *, PyObject *args) {
    PyObject *dicts, *names, *expected;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &dicts, &PyTuple_Type, &names,
                          &PyList_Type, &expected))
        return nullptr;
    const Py_ssize_t n = PyList_GET_SIZE(dicts), m = PyTuple_GET_SIZE(names);
    if (PyList_GET_SIZE(expected) != n * m) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d)) Py_RETURN_FALSE;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(names, k));
            if (v == nullptr) {
                if (PyErr_Occurred()) return nullptr;
                Py_RETURN_FALSE;
            }
            if (v != PyList_GET_ITEM(expected, k * n + i)) Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

// gather_int32(addresses, n, out): out[i] = *(int32_t *)addresses[i] for i < n (the step
// counters of a group, stacked without a tensor op a counter).
PyObject *gather_int32(PyObject *, PyObject *args) {
    unsigned long long addresses, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KnK", &addresses, &n, &out)) return nullptr;
    const int64_t *from = reinterpret_cast<const int64_t *>(static_cast<uintptr_t>(addresses));
    int32_t *to = reinterpret_cast<int32_t *>(static_cast<uintptr_t>(out));
    for (Py_ssize_t i = 0; i < n; i++)
        to[i] = *reinterpret_cast<const int32_t *>(static_cast<uintptr_t>(from[i]));
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"gather_int32", gather_int32, METH_VARARGS, "gather_int32(addresses, n, out)"},
    {"same_items", same_items, METH_VARARGS, "same_items(dicts, names, expected)"},
    {"init", init, METH_VARARGS, "init(torch.Tensor, offset of the TensorImpl pointer)"},
    {"scan", scan, METH_VARARGS, "scan(tensors, address, grads)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "vega_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_vega_native(void) { return PyModule_Create(&module); }
