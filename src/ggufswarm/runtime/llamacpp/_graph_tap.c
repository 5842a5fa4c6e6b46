/*
 * Graph tap: a compiled ggml scheduler eval callback (ggml_backend_sched_eval_callback, ggml-backend.h)
 * that copies one named graph tensor -- a shard's last block output, e.g. "l_out-5" -- into a caller
 * buffer and then stops the graph, so llama.cpp never computes the output norm and LM head of a
 * non-head shard. ggml calls it twice per graph node (ask, then observe), so it is compiled: a Python
 * callback would add a ctypes round trip per node to every step.
 *
 * The ggml functions it needs are passed in through the tap struct (resolved by the Python side
 * from the ggml library llama-cpp-python loaded), so this module links against nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef const char *(*gs_get_name_fn)(const void *tensor);
typedef void (*gs_tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);
typedef size_t (*gs_nbytes_fn)(const void *tensor);

/* Mirrored by GraphTap (ctypes.Structure) in llamacpp.py: keep the two in the same order. */
struct gs_tap {
    gs_get_name_fn get_name;     /* ggml_get_name */
    gs_tensor_get_fn tensor_get; /* ggml_backend_tensor_get */
    gs_nbytes_fn nbytes;         /* ggml_nbytes */
    char *dst;                   /* output buffer: rows of the captured tensor, appended per ubatch */
    size_t capacity;             /* bytes available at dst */
    size_t filled;               /* bytes written since the caller last reset it */
    int32_t stop;                /* nonzero: cancel the rest of the graph after the capture */
    int32_t overflow;            /* set to 1 when a capture did not fit (nothing copied then) */
    char target[64];             /* name of the tensor to capture; "" captures nothing */
};

static bool gs_tap_eval(void *tensor, bool ask, void *user_data) {
    struct gs_tap *tap = (struct gs_tap *)user_data;
    if (tap->target[0] == '\0' || strcmp(tap->get_name(tensor), tap->target) != 0) {
        return !ask; /* not ours: don't ask to observe it; if observed anyway, go on */
    }
    if (ask) {
        return true;
    }
    size_t n = tap->nbytes(tensor);
    if (tap->filled + n > tap->capacity) {
        tap->overflow = 1;
        return false;
    }
    tap->tensor_get(tensor, tap->dst + tap->filled, 0, n);
    tap->filled += n;
    return tap->stop == 0;
}

static PyObject *callback_address(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromVoidPtr((void *)&gs_tap_eval);
}

static PyObject *tap_size(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromSize_t(sizeof(struct gs_tap));
}

static PyMethodDef methods[] = {
    {"callback_address", callback_address, METH_NOARGS, "Address of the C eval callback (int)."},
    {"tap_size", tap_size, METH_NOARGS, "sizeof(struct gs_tap) in bytes, to check the ctypes mirror."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_graph_tap",
    "Compiled ggml eval callback capturing one named graph tensor (see llamacpp.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__graph_tap(void) { return PyModule_Create(&module); }
