/* urc._native._pack: pack(tokens) -> array('q')
 *
 * The packed form of a list or tuple of token ids (urc.key): one int64 per token, in an
 * ``array('q')``.  ``array('q', tokens)`` does the same through a generic per-item setter
 * (about 20 ns a token here); this reads each int directly (a few ns).  A sequence holding
 * anything but ints (bools and other int subclasses are ints) is handed to ``array('q',
 * tokens)`` itself, whose errors then say what is wrong: TypeError for a non-integer,
 * OverflowError outside int64.  No Python code runs while the items are read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *array_type; /* array.array */
static PyObject *typecode;   /* "q" */
static PyObject *frombytes;  /* "frombytes" */

/* The ids are converted into this scratch buffer, reused from call to call, then copied
 * into the new array with one allocation of its exact size: a temporary buffer per call
 * would be a fresh mapping of a long key's size, faulted in page by page and unmapped again
 * (glibc maps big blocks), which costs more than the conversion. */
static int64_t *scratch;
static Py_ssize_t scratch_len;

/* 1 with ``*out`` set: the exact int ``x`` is compact (every id below 2**30 on 3.11), read in
 * place (about a third of ``PyLong_AsLongLongAndOverflow``'s cost); 0: convert it the long
 * way. */
static inline int
compact(PyObject *x, int64_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)x)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)x);
        return 1;
    }
#elif !defined(Py_LIMITED_API)
    const Py_ssize_t size = Py_SIZE(x); /* 3.11: the sign and digit count */
    if (size >= -1 && size <= 1) {
        *out = size == 0 ? 0 : size * (int64_t)((PyLongObject *)x)->ob_digit[0];
        return 1;
    }
#endif
    return 0;
}

static PyObject *
pack(PyObject *self, PyObject *seq)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "pack: a list or tuple of ints, got %.100s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > scratch_len) {
        int64_t *grown = PyMem_Realloc(scratch, (size_t)n * sizeof(int64_t));
        if (grown == NULL)
            return PyErr_NoMemory();
        scratch = grown;
        scratch_len = n;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = items[i];
        int overflow;
        long long v;
        if (PyLong_CheckExact(x) && compact(x, &scratch[i]))
            continue;
        if (!PyLong_Check(x) || ((v = PyLong_AsLongLongAndOverflow(x, &overflow)) == -1 &&
                                 (overflow || PyErr_Occurred()))) {
            /* Not an int, or out of range: the generic constructor raises the right error
             * (or converts what has an __index__). */
            PyErr_Clear();
            return PyObject_CallFunctionObjArgs(array_type, typecode, seq, NULL);
        }
        scratch[i] = (int64_t)v;
    }
    PyObject *res = PyObject_CallOneArg(array_type, typecode);
    if (res == NULL || n == 0)
        return res;
    PyObject *view = PyMemoryView_FromMemory((char *)scratch, n * (Py_ssize_t)sizeof(int64_t),
                                             PyBUF_READ);
    PyObject *r = view == NULL ? NULL : PyObject_CallMethodOneArg(res, frombytes, view);
    Py_XDECREF(view);
    if (r == NULL) {
        Py_DECREF(res);
        return NULL;
    }
    Py_DECREF(r);
    return res;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O, "pack(tokens) -> array('q'): a list or tuple of ints, packed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__pack(void)
{
    PyObject *array_mod = PyImport_ImportModule("array");
    if (array_mod == NULL)
        return NULL;
    array_type = PyObject_GetAttrString(array_mod, "array");
    Py_DECREF(array_mod);
    typecode = PyUnicode_InternFromString("q");
    frombytes = PyUnicode_InternFromString("frombytes");
    if (array_type == NULL || typecode == NULL || frombytes == NULL)
        return NULL;
    return PyModule_Create(&module);
}
