/* urc._native._gckeys: untrack(key) -> None
 *
 * Takes a node's key list off the cyclic garbage collector's lists.  A key holds token ids
 * (ints, or tuples of ints for EAGLE bigram keys) and the tree never mutates it (a split
 * slices new lists), so it can never be part of a reference cycle: the collector has nothing
 * to find in it.  Tracked, every young key is still traversed item by item by the next
 * collections -- for a 16k-token leaf that is 16k visits of cold token objects, which with
 * the default GC thresholds about doubled a long-context insert.  Reference counting frees
 * an untracked list as usual.  Anything but an exact list is left alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
untrack(PyObject *self, PyObject *key)
{
    if (PyList_CheckExact(key) && PyObject_GC_IsTracked(key))
        PyObject_GC_UnTrack(key);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"untrack", untrack, METH_O, "untrack(key) -> None: take a key list off the cyclic GC"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gckeys", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__gckeys(void)
{
    return PyModule_Create(&module);
}
