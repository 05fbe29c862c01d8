/* urc._native._gckeys: untrack(key) -> None
 *
 * Takes a node's key off the cyclic garbage collector's lists.  A key is a packed
 * ``array('q')`` or, for EAGLE bigram keys, a list of int pairs, and the tree never mutates
 * it (a split slices new ones), so it can never be part of a reference cycle: the collector
 * has nothing to find in it.  Tracked, every young key is still visited by the next
 * collections -- for a 16k-token bigram list that is 16k visits of cold objects, which with
 * the default GC thresholds about doubled a long-context insert (an array costs one visit).
 * Reference counting frees an untracked key as usual.  Anything but an exact list or
 * ``array.array`` is left alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyTypeObject *array_type; /* array.array */

static PyObject *
untrack(PyObject *self, PyObject *key)
{
    if ((PyList_CheckExact(key) || Py_IS_TYPE(key, array_type)) && PyObject_GC_IsTracked(key))
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
    PyObject *array_mod = PyImport_ImportModule("array");
    if (array_mod == NULL)
        return NULL;
    array_type = (PyTypeObject *)PyObject_GetAttrString(array_mod, "array");
    Py_DECREF(array_mod);
    if (array_type == NULL)
        return NULL;
    return PyModule_Create(&module);
}
