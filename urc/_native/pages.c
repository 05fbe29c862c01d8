/* urc._native._pages: the compiled twins of urc.pageops.py_count_held / py_release /
 * py_unmap (see their docstrings).  They work on numpy arrays through the buffer protocol: ``state`` int8 (one
 * entry per page), ``stack`` and ``idx`` int64; ``idx`` may be strided (a sliced tensor's
 * host view), and ``idx[start:end]`` is used.  No Python code runs inside them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* A 1-D buffer of ``itemsize``-byte items, or -1 with an exception set. */
static int
get_1d(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *name)
{
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of %zd-byte items", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* An int64 index sequence: its first item and its stride in bytes. */
typedef struct {
    const char *base;
    Py_ssize_t n;
    Py_ssize_t stride;
    Py_buffer view;
} Idx;

/* ``idx[start:end]`` of a 1-D int64 buffer; -1 with an exception. */
static int
get_idx(PyObject *obj, Py_ssize_t start, Py_ssize_t end, Idx *out)
{
    if (get_1d(obj, &out->view, 8, 0, "idx") < 0)
        return -1;
    out->base = (const char *)out->view.buf;
    out->n = out->view.shape[0];
    out->stride = out->view.strides[0];
    if (end > out->n)
        end = out->n;
    if (start < 0 || start > end) {
        PyErr_SetString(PyExc_ValueError, "idx: need 0 <= start <= end");
        PyBuffer_Release(&out->view);
        return -1;
    }
    out->base += start * out->stride;
    out->n = end - start;
    return 0;
}

static void
release_idx(Idx *idx)
{
    PyBuffer_Release(&idx->view);
}

/* The shared arguments: idx, start, end, step, shift at args[0..4]. */
static int
parse_common(PyObject *const *args, Idx *idx, Py_ssize_t *step, Py_ssize_t *shift)
{
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    *step = PyLong_AsSsize_t(args[3]);
    *shift = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return -1;
    if (*step < 1 || *shift < 0 || *shift > 62) {
        PyErr_SetString(PyExc_ValueError, "step >= 1 and 0 <= shift <= 62");
        return -1;
    }
    return get_idx(args[0], start, end, idx);
}

/* count_held(state, idx, start, end, step, shift, bound) -> int */
static PyObject *
count_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "count_held(state, idx, start, end, step, shift, bound)");
        return NULL;
    }
    long long bound = PyLong_AsLongLong(args[6]);
    if (bound == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer st;
    if (get_1d(args[0], &st, 1, 0, "state") < 0)
        return NULL;
    Idx ix;
    Py_ssize_t step, shift;
    if (parse_common(args + 1, &ix, &step, &shift) < 0) {
        PyBuffer_Release(&st);
        return NULL;
    }
    const signed char *const state = (const signed char *)st.buf;
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    const char *const ip = ix.base;
    const Py_ssize_t stride = ix.stride;
    const Py_ssize_t n = ix.n;
    long long held = 0;
    unsigned long long bad = 0;
    if (bound >= 0) {
        for (Py_ssize_t i = 0; i < n; i++)
            bad |= (unsigned long long)(*(const long long *)(ip + i * stride)) >=
                   (unsigned long long)bound;
    }
    if (stride == 8 && step == 1 && shift == 0) {
        /* Page 1, a contiguous span (the usual value): no early exit and a clamped load, so
         * the loop has no branch; an out-of-range page still makes the answer -1. */
        const unsigned long long *const pages = (const unsigned long long *)ip;
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned long long p = pages[i];
            const unsigned long long in = p < num_pages;
            bad |= in ^ 1;
            held += state[in ? p : 0] != 0;
        }
    }
    else {
        for (Py_ssize_t i = 0; i < n && !bad; i += step) {
            unsigned long long p =
                (unsigned long long)(*(const long long *)(ip + i * stride) >> shift);
            if (p >= num_pages)
                bad = 1;
            else
                held += state[p] != 0;
        }
    }
    release_idx(&ix);
    PyBuffer_Release(&st);
    return PyLong_FromLongLong(bad ? -1 : held);
}

/* release(state, stack, top, idx, start, end, step, shift) -> new top */
static PyObject *
release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "release(state, stack, top, idx, start, end, step, shift)");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[2]);
    if (top == -1 && PyErr_Occurred())
        return NULL;
    if (top < 0) {
        PyErr_SetString(PyExc_ValueError, "release: top >= 0");
        return NULL;
    }
    Py_buffer st, sk;
    if (get_1d(args[0], &st, 1, 1, "state") < 0)
        return NULL;
    if (get_1d(args[1], &sk, 8, 1, "stack") < 0) {
        PyBuffer_Release(&st);
        return NULL;
    }
    Idx ix;
    Py_ssize_t step, shift;
    if (parse_common(args + 3, &ix, &step, &shift) < 0) {
        PyBuffer_Release(&sk);
        PyBuffer_Release(&st);
        return NULL;
    }
    Py_ssize_t count = (ix.n + step - 1) / step;
    PyObject *res = NULL;
    if (sk.strides[0] != 8) {
        PyErr_SetString(PyExc_TypeError, "release: stack must be contiguous");
        goto done;
    }
    if (top + count > sk.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "release: more pages than the stack holds");
        goto done;
    }
    /* Locals, not the buffer structs: a store through a char pointer could alias them, and
     * the compiler would reload every field on every iteration. */
    const char *ip = ix.base;
    const Py_ssize_t istride = ix.stride * step;
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    signed char *const state = (signed char *)st.buf;
    long long *const stack = (long long *)sk.buf;
    /* Validate every page first: nothing changes when one is out of range. */
    int bad = 0;
    if (istride == 8 && shift == 0) {
        /* Page 1, a contiguous span: the pages are the indices (a vectorizable check, one
         * block copy onto the stack, then the state stores). */
        const unsigned long long *const pages = (const unsigned long long *)ip;
        for (Py_ssize_t i = 0; i < count; i++)
            bad |= pages[i] >= num_pages;
        if (bad) {
            PyErr_SetString(PyExc_IndexError, "release: page out of range");
            goto done;
        }
        memcpy(stack + top, pages, (size_t)count * sizeof(long long));
        for (Py_ssize_t i = 0; i < count; i++)
            state[pages[i]] = 0;
    }
    else {
        for (Py_ssize_t i = 0; i < count; i++)
            bad |= (unsigned long long)(*(const long long *)(ip + i * istride) >> shift) >=
                   num_pages;
        if (bad) {
            PyErr_SetString(PyExc_IndexError, "release: page out of range");
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            long long p = *(const long long *)(ip + i * istride) >> shift;
            state[p] = 0;
            stack[top + i] = p;
        }
    }
    res = PyLong_FromSsize_t(top + count);
done:
    release_idx(&ix);
    PyBuffer_Release(&sk);
    PyBuffer_Release(&st);
    return res;
}

/* unmap(map, state, stack, top, idx, start, end, step, shift) -> new top
 * For every page p = idx[start:end][::step] >> shift: s = map[p]; map[p] = -1; and when
 * s >= 0, page s of the other pool is marked free (state[s] = 0) and pushed on its stack. */
static PyObject *
unmap(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "unmap(map, state, stack, top, idx, start, end, step, shift)");
        return NULL;
    }
    Py_ssize_t top = PyLong_AsSsize_t(args[3]);
    if (top == -1 && PyErr_Occurred())
        return NULL;
    if (top < 0) {
        PyErr_SetString(PyExc_ValueError, "unmap: top >= 0");
        return NULL;
    }
    Py_buffer mp, st, sk;
    if (get_1d(args[0], &mp, 8, 1, "map") < 0)
        return NULL;
    if (get_1d(args[1], &st, 1, 1, "state") < 0) {
        PyBuffer_Release(&mp);
        return NULL;
    }
    if (get_1d(args[2], &sk, 8, 1, "stack") < 0) {
        PyBuffer_Release(&st);
        PyBuffer_Release(&mp);
        return NULL;
    }
    Idx ix;
    Py_ssize_t step, shift;
    if (parse_common(args + 4, &ix, &step, &shift) < 0) {
        PyBuffer_Release(&sk);
        PyBuffer_Release(&st);
        PyBuffer_Release(&mp);
        return NULL;
    }
    PyObject *res = NULL;
    if (mp.strides[0] != 8 || sk.strides[0] != 8) {
        PyErr_SetString(PyExc_TypeError, "unmap: map and stack must be contiguous");
        goto done;
    }
    const Py_ssize_t count = (ix.n + step - 1) / step;
    const char *ip = ix.base;
    const Py_ssize_t istride = ix.stride * step;
    const unsigned long long map_len = (unsigned long long)mp.shape[0];
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    long long *const map = (long long *)mp.buf;
    signed char *const state = (signed char *)st.buf;
    long long *const stack = (long long *)sk.buf;
    /* Validate first (nothing changes on an error): pages in range, mapped targets in
     * range, and room on the stack for every mapped target. */
    Py_ssize_t mapped = 0;
    int bad = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        unsigned long long p =
            (unsigned long long)(*(const long long *)(ip + i * istride) >> shift);
        if (p >= map_len) {
            bad = 1;
            break;
        }
        long long s = map[p];
        if (s >= 0) {
            bad |= (unsigned long long)s >= num_pages;
            mapped++;
        }
    }
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "unmap: page out of range");
        goto done;
    }
    if (top + mapped > sk.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "unmap: more pages than the stack holds");
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long long p = *(const long long *)(ip + i * istride) >> shift;
        long long s = map[p];
        map[p] = -1;
        if (s >= 0) {
            state[s] = 0;
            stack[top++] = s;
        }
    }
    res = PyLong_FromSsize_t(top);
done:
    release_idx(&ix);
    PyBuffer_Release(&sk);
    PyBuffer_Release(&st);
    PyBuffer_Release(&mp);
    return res;
}

static PyMethodDef methods[] = {
    {"count_held", (PyCFunction)(void (*)(void))count_held, METH_FASTCALL,
     "count_held(state, idx, start, end, step, shift, bound) -> int"},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "release(state, stack, top, idx, start, end, step, shift) -> int"},
    {"unmap", (PyCFunction)(void (*)(void))unmap, METH_FASTCALL,
     "unmap(map, state, stack, top, idx, start, end, step, shift) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pages", "Compiled page bookkeeping (see urc.pageops).", -1, methods,
};

PyMODINIT_FUNC
PyInit__pages(void)
{
    return PyModule_Create(&module);
}
