/* urc._native._walk: the compiled twins of urc.fastpath.py_walk and py_match_tail, and of
 * urc.components.swa_window.py_window_locked and py_window_release (see their docstrings).
 *
 * walk(node, ck, tokens, pos, page_size) -> (nodes, pos, partial, m)
 * match_tail(path, rules, clock, with_values) -> (k, hit, clock, values)
 * window_locked(node, index, params, window) -> locked
 * window_release(node, index, params, window) -> delta
 *
 * ``ck`` None: the first child is looked up under the page key at ``pos``, like every later
 * one.
 *
 * walk is read-only: it follows ``tokens[pos:]`` down the radix tree from ``node`` (first
 * child key ``ck``, then ``tokens[pos]`` or the bytes of the next page) and changes nothing.
 * Tokens and node keys are packed ``array('q')`` keys (urc.key): edges compare with memcmp,
 * exactly what comparing two array slices does, without building the slices.  match_tail
 * stamps the nodes of the hit it finds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

/* A slot read or written by name, with its offset cached for the last type seen: on that
 * exact type it is a load or a store, not a generic attribute lookup (any other type, or a
 * slot not set, takes PyObject_GetAttr / PyObject_SetAttr). */
typedef struct {
    const char *cname;
    PyObject *name;
    PyTypeObject *type; /* held: a freed type's address could come back with another layout */
    Py_ssize_t off;
} slot_cache;

static slot_cache sc_children = {"children"}, sc_key = {"key"}, sc_key_len = {"key_len"},
                  sc_data = {"data"}, sc_full = {"full"}, sc_value = {"value"},
                  sc_stamp = {"last_access_time"},
                  sc_rule_value = {"value"}; /* a rule's component data: its own type */

/* The slot offset of ``c`` on ``type`` (-1: not a plain object slot), cached. */
static inline Py_ssize_t
slot_offset(slot_cache *c, PyTypeObject *type)
{
    if (type == c->type)
        return c->off;
    PyObject *d = _PyType_Lookup(type, c->name); /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX)
        return -1;
    Py_INCREF(type);
    Py_XDECREF(c->type);
    c->type = type;
    c->off = m->offset;
    return c->off;
}

/* Borrowed ``obj.<c>`` when it is a set slot of a cached type, else NULL (no exception). */
static inline PyObject *
peek_slot(PyObject *obj, slot_cache *c)
{
    Py_ssize_t off = slot_offset(c, Py_TYPE(obj));
    return off < 0 ? NULL : *(PyObject **)((char *)obj + off);
}

/* New reference to ``obj.<c>`` (NULL with an exception). */
static inline PyObject *
get_slot(PyObject *obj, slot_cache *c)
{
    PyObject *v = peek_slot(obj, c);
    if (v != NULL) {
        Py_INCREF(v);
        return v;
    }
    return PyObject_GetAttr(obj, c->name);
}

/* ``obj.<c> = v`` (steals ``v``); -1 with an exception. */
static inline int
set_slot(PyObject *obj, slot_cache *c, PyObject *v)
{
    if (v == NULL)
        return -1;
    Py_ssize_t off = slot_offset(c, Py_TYPE(obj));
    if (off >= 0) {
        PyObject **p = (PyObject **)((char *)obj + off);
        PyObject *old = *p;
        *p = v;
        Py_XDECREF(old);
        return 0;
    }
    int r = PyObject_SetAttr(obj, c->name, v);
    Py_DECREF(v);
    return r;
}

/* Packed keys: node keys and walked tokens are ``array('q')`` (int64), read through the buffer
 * protocol.  The items of ``o`` (a 1-D buffer of format "q"), with ``b`` to release; NULL
 * with a TypeError otherwise.  An exported array cannot be resized, so the pointer stays
 * valid until the release whatever runs meanwhile. */
static const int64_t *
view_i64(PyObject *o, Py_buffer *b, const char *what)
{
    if (PyObject_GetBuffer(o, b, PyBUF_FORMAT | PyBUF_ND) == 0) {
        if (b->ndim == 1 && b->itemsize == 8 && b->format != NULL && strcmp(b->format, "q") == 0)
            return (const int64_t *)b->buf;
        PyBuffer_Release(b);
    }
    else {
        PyErr_Clear();
    }
    PyErr_Format(PyExc_TypeError, "walk: %s must be an array('q'), got %.100s", what,
                 Py_TYPE(o)->tp_name);
    return NULL;
}

/* Common prefix length of two runs of n tokens.  One memcmp decides the usual case (the
 * whole edge matches); a mismatch is then located block by block. */
static Py_ssize_t
common_i64(const int64_t *a, const int64_t *b, Py_ssize_t n)
{
    if (memcmp(a, b, (size_t)n * sizeof(int64_t)) == 0)
        return n;
    enum { BLOCK = 64 };
    Py_ssize_t i = 0;
    while (i + BLOCK <= n && memcmp(a + i, b + i, BLOCK * sizeof(int64_t)) == 0)
        i += BLOCK;
    while (a[i] == b[i]) /* a mismatch lies before n */
        i++;
    return i;
}

/* The child key of the page at ``t`` (``urc.fastpath.page_key``): the token as an int (page
 * 1) or the page's bytes. */
static PyObject *
child_key(const int64_t *t, Py_ssize_t ps)
{
    if (ps == 1)
        return PyLong_FromLongLong(t[0]);
    return PyBytes_FromStringAndSize((const char *)t, ps * (Py_ssize_t)sizeof(int64_t));
}

/* Up to this many children, a lookup scans the child keys instead of building the page's key
 * object (an int, or a tuple of ps ints) and hashing it: most keys differ at their first
 * token, so a scan of a few costs less than the allocations. */
enum { SCAN_CHILDREN = 16 };

/* 1: ``k`` is the exact int ``v``; 0: it is not; -1: not decidable here (an int subclass).
 * A compact int (every token id below 2**30 on 3.11) is read in place.  Runs no Python
 * code. */
static inline int
int_is(PyObject *k, int64_t v)
{
    if (!PyLong_CheckExact(k))
        return PyLong_Check(k) ? -1 : 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)k))
        return (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)k) == v;
#elif !defined(Py_LIMITED_API)
    const Py_ssize_t size = Py_SIZE(k); /* 3.11: the sign and digit count */
    if (size >= -1 && size <= 1)
        return (size == 0 ? 0 : size * (int64_t)((PyLongObject *)k)->ob_digit[0]) == v;
#endif
    int overflow;
    const long long x = PyLong_AsLongLongAndOverflow(k, &overflow);
    return !overflow && x == v; /* no error is possible on an exact int */
}

/* The child of ``children`` held under the page key of ``t[0:ps]`` -- what
 * ``children.get(page_key(...))`` gives -- found without building the key: an int key is
 * compared by value, a page's bytes with one memcmp (a key of another shape, such as a
 * namespaced root key, never equals the page key and is skipped).  1: decided (``*out`` the
 * child, borrowed, or NULL for none); 0: not decidable here (too many children, or an int
 * subclass key): build the key and look it up.  Runs no Python code, so the dict cannot
 * change under the iteration. */
static int
scan_keys(PyObject *children, const int64_t *t, Py_ssize_t ps, PyObject **out)
{
    *out = NULL;
    if (PyDict_GET_SIZE(children) > SCAN_CHILDREN)
        return 0;
    const Py_ssize_t nbytes = ps * (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t it = 0;
    PyObject *k, *v;
    while (PyDict_Next(children, &it, &k, &v)) {
        int same;
        if (ps == 1) {
            same = int_is(k, t[0]);
            if (same < 0)
                return 0;
        }
        else {
            same = PyBytes_CheckExact(k) && PyBytes_GET_SIZE(k) == nbytes &&
                   memcmp(PyBytes_AS_STRING(k), t, (size_t)nbytes) == 0;
        }
        if (same) {
            *out = v;
            return 1;
        }
    }
    return 1;
}

/* The tuple of four new references (stolen, also on failure; NULL: an earlier allocation
 * failed).  What ``Py_BuildValue`` builds, without parsing a format on every call: the walk
 * and a match's tail each return one, and the parsing cost about a twentieth of a match. */
static PyObject *
steal_tuple4(PyObject *a, PyObject *b, PyObject *c, PyObject *d)
{
    PyObject *items[4] = {a, b, c, d};
    PyObject *t = NULL;
    if (a != NULL && b != NULL && c != NULL && d != NULL)
        t = PyTuple_New(4);
    for (int i = 0; i < 4; i++) {
        if (t != NULL)
            PyTuple_SET_ITEM(t, i, items[i]);
        else
            Py_XDECREF(items[i]);
    }
    return t;
}

static PyObject *
walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "walk(node, ck, tokens, pos, page_size)");
        return NULL;
    }
    PyObject *node = args[0];
    Py_ssize_t pos = PyLong_AsSsize_t(args[3]);
    Py_ssize_t ps = PyLong_AsSsize_t(args[4]);
    if ((pos == -1 || ps == -1) && PyErr_Occurred())
        return NULL;
    if (ps < 1 || pos < 0) {
        PyErr_SetString(PyExc_ValueError, "walk: page_size must be positive, pos not negative");
        return NULL;
    }
    Py_buffer tb;
    const int64_t *t = view_i64(args[2], &tb, "tokens");
    if (t == NULL)
        return NULL;
    const Py_ssize_t n = tb.shape[0];
    PyObject *nodes = PyList_New(0);
    if (nodes == NULL) {
        PyBuffer_Release(&tb);
        return NULL;
    }
    PyObject *ck = args[1] == Py_None ? NULL : args[1]; /* NULL: the page key at pos */
    Py_XINCREF(ck);
    Py_INCREF(node);
    PyObject *partial = Py_None;
    Py_ssize_t pm = 0;
    while (pos < n) {
        PyObject *children = get_slot(node, &sc_children);
        if (children == NULL)
            goto fail;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "walk: node.children must be a dict");
            goto fail;
        }
        PyObject *child = NULL; /* borrowed */
        if (ck == NULL && (n - pos < ps || scan_keys(children, t + pos, ps, &child) == 0)) {
            ck = child_key(t + pos, n - pos < ps ? n - pos : ps);
            if (ck == NULL) {
                Py_DECREF(children);
                goto fail;
            }
        }
        if (ck != NULL)
            child = PyDict_GetItemWithError(children, ck);
        Py_XINCREF(child);
        Py_DECREF(children);
        Py_CLEAR(ck);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        PyObject *edge = get_slot(child, &sc_key);
        if (edge == NULL) {
            Py_DECREF(child);
            goto fail;
        }
        Py_buffer eb;
        const int64_t *e = view_i64(edge, &eb, "node.key");
        Py_DECREF(edge); /* the child holds it; the export pins its items */
        if (e == NULL) {
            Py_DECREF(child);
            goto fail;
        }
        const Py_ssize_t klen = eb.shape[0];
        const Py_ssize_t lim = klen < n - pos ? klen : n - pos;
        Py_ssize_t c = common_i64(e, t + pos, lim);
        PyBuffer_Release(&eb);
        if (c == klen) {
            if (PyList_Append(nodes, child) < 0) {
                Py_DECREF(child);
                goto fail;
            }
            Py_DECREF(node);
            node = child;
            pos += klen;
            continue;
        }
        c -= c % ps;
        if (c > 0) {
            partial = child; /* owned */
            pm = c;
        }
        else {
            Py_DECREF(child);
        }
        break;
    }
    PyBuffer_Release(&tb);
    Py_XDECREF(ck);
    Py_DECREF(node);
    if (partial == Py_None)
        Py_INCREF(Py_None);
    return steal_tuple4(nodes, PyLong_FromSsize_t(pos), partial, PyLong_FromSsize_t(pm));
fail:
    PyBuffer_Release(&tb);
    Py_XDECREF(ck);
    Py_DECREF(node);
    Py_DECREF(nodes);
    return NULL;
}

/* ``node.<c>`` as a C integer; -1 with an exception. */
static Py_ssize_t
int_slot(PyObject *node, slot_cache *c)
{
    PyObject *v = get_slot(node, c);
    if (v == NULL)
        return -1;
    Py_ssize_t r = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return r;
}

/* Whether ``node.data[ct].value is not None``: 1, 0, or -1 with an exception. */
static int
has_value(PyObject *node, Py_ssize_t ct)
{
    PyObject *data = get_slot(node, &sc_data);
    if (data == NULL)
        return -1;
    PyObject *cd = PySequence_GetItem(data, ct);
    Py_DECREF(data);
    if (cd == NULL)
        return -1;
    PyObject *v = get_slot(cd, &sc_rule_value);
    Py_DECREF(cd);
    if (v == NULL)
        return -1;
    int r = v != Py_None;
    Py_DECREF(v);
    return r;
}

/* Whether the rule (ct, window) accepts path[:i] (see py_deepest_boundary): 1, 0, -1. */
static int
rule_accepts(PyObject *path, Py_ssize_t i, Py_ssize_t ct, Py_ssize_t window)
{
    Py_ssize_t acc = 0;
    for (Py_ssize_t j = i - 1; j >= 0; j--) {
        if (j >= PyList_GET_SIZE(path)) { /* only if an attribute hook resized it */
            PyErr_SetString(PyExc_RuntimeError, "match_tail: path changed size");
            return -1;
        }
        PyObject *node = PyList_GET_ITEM(path, j);
        Py_INCREF(node);
        int r = has_value(node, ct);
        Py_ssize_t len = r > 0 ? int_slot(node, &sc_key_len) : 0;
        Py_DECREF(node);
        if (r <= 0)
            return r;
        if (len == -1 && PyErr_Occurred())
            return -1;
        acc += len;
        if (acc >= window)
            return 1;
    }
    return 1; /* the component's data all the way up from the root */
}

enum { MAX_RULES = 8 };

static PyObject *
match_tail(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "match_tail(path, rules, clock, with_values)");
        return NULL;
    }
    PyObject *path = args[0], *rules = args[1];
    if (!PyList_Check(path) || !PyTuple_Check(rules)) {
        PyErr_SetString(PyExc_TypeError, "match_tail: path must be a list, rules a tuple");
        return NULL;
    }
    Py_ssize_t nrules = PyTuple_GET_SIZE(rules), ct[MAX_RULES], window[MAX_RULES];
    if (nrules > MAX_RULES) {
        PyErr_SetString(PyExc_ValueError, "match_tail: too many rules");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < nrules; r++) { /* (component index, window) pairs */
        PyObject *rule = PyTuple_GET_ITEM(rules, r);
        if (!PyTuple_Check(rule) || PyTuple_GET_SIZE(rule) != 2) {
            PyErr_SetString(PyExc_TypeError, "match_tail: a rule must be a pair of ints");
            return NULL;
        }
        ct[r] = PyLong_AsSsize_t(PyTuple_GET_ITEM(rule, 0));
        window[r] = PyLong_AsSsize_t(PyTuple_GET_ITEM(rule, 1));
        if ((ct[r] == -1 || window[r] == -1) && PyErr_Occurred())
            return NULL;
    }
    long long clock = PyLong_AsLongLong(args[2]);
    if (clock == -1 && PyErr_Occurred())
        return NULL;
    int with_values = PyObject_IsTrue(args[3]);
    if (with_values < 0)
        return NULL;
    /* The hit: the deepest i that every rule accepts (asked from the deepest node up). */
    Py_ssize_t k = PyList_GET_SIZE(path);
    if (nrules) {
        for (; k > 0; k--) {
            int ok = 1;
            for (Py_ssize_t r = 0; r < nrules && ok; r++) {
                ok = rule_accepts(path, k, ct[r], window[r]);
                if (ok < 0)
                    return NULL;
            }
            if (ok)
                break;
        }
    }
    /* Stamp path[:k] root first, count its tokens, gather its Full values. */
    PyObject *values = with_values ? PyList_New(k) : Py_NewRef(Py_None);
    if (values == NULL)
        return NULL;
    Py_ssize_t hit = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (j >= PyList_GET_SIZE(path)) {
            PyErr_SetString(PyExc_RuntimeError, "match_tail: path changed size");
            goto fail;
        }
        PyObject *node = PyList_GET_ITEM(path, j);
        Py_INCREF(node);
        clock++;
        Py_ssize_t len = -1;
        if (set_slot(node, &sc_stamp, PyLong_FromLongLong(clock)) == 0)
            len = int_slot(node, &sc_key_len);
        if (len == -1 && PyErr_Occurred()) {
            Py_DECREF(node);
            goto fail;
        }
        hit += len;
        if (with_values) {
            PyObject *full = get_slot(node, &sc_full);
            PyObject *v = full == NULL ? NULL : get_slot(full, &sc_value);
            Py_XDECREF(full);
            if (v == NULL) {
                Py_DECREF(node);
                goto fail;
            }
            PyList_SET_ITEM(values, j, v);
        }
        Py_DECREF(node);
    }
    return steal_tuple4(PyLong_FromSsize_t(k), PyLong_FromSsize_t(hit), PyLong_FromLongLong(clock),
                        values);
fail:
    Py_DECREF(values);
    return NULL;
}

/* ------------------------------------------------------------------ SWA window release */
static slot_cache sc_parent = {"parent"}, sc_id = {"id"}, sc_on_device = {"on_device"},
                  sc_swa = {"swa"}, sc_mamba = {"mamba"},
                  sc_lock_ref = {"lock_ref"}, sc_restored = {"restored"}, sc_uuid = {"uuid"},
                  sc_r_uuid = {"swa_uuid_for_lock"}, sc_r_skip = {"skip_lock_node_ids"},
                  sc_r_epoch = {"swa_lock_epoch"};

/* urc.errors.InvalidLockError, imported on first use. */
static PyObject *lock_error;

/* Raise InvalidLockError(msg) (steals ``msg``); always NULL. */
static PyObject *
raise_lock_error(PyObject *msg)
{
    if (msg == NULL)
        return NULL;
    if (lock_error == NULL) {
        PyObject *mod = PyImport_ImportModule("urc.errors");
        if (mod != NULL) {
            lock_error = PyObject_GetAttrString(mod, "InvalidLockError");
            Py_DECREF(mod);
        }
        if (lock_error == NULL) {
            Py_DECREF(msg);
            return NULL;
        }
    }
    PyErr_SetObject(lock_error, msg);
    Py_DECREF(msg);
    return NULL;
}

/* New reference to ``node.data[index]``; NULL with an exception.  Read from the node's
 * attribute for that ComponentType (``full``, ``swa``, ``mamba``), not from the tuple: the
 * lock that this walk releases never read the tuple, so its line is cold. */
static PyObject *
component_data(PyObject *node, Py_ssize_t index)
{
    static slot_cache *const by_type[] = {&sc_full, &sc_swa, &sc_mamba};
    if (index >= 0 && index < (Py_ssize_t)(sizeof(by_type) / sizeof(by_type[0])))
        return get_slot(node, by_type[index]);
    PyObject *data = get_slot(node, &sc_data);
    if (data == NULL)
        return NULL;
    PyObject *cd = PySequence_GetItem(data, index);
    Py_DECREF(data);
    return cd;
}

/* ``cd.lock_ref += by``; -1 with an exception. */
static int
add_lock_ref(PyObject *cd, Py_ssize_t by)
{
    Py_ssize_t lr = int_slot(cd, &sc_lock_ref);
    if (lr == -1 && PyErr_Occurred())
        return -1;
    return set_slot(cd, &sc_lock_ref, PyLong_FromSsize_t(lr + by));
}

/* Whether the window walk counts ``node`` (SWA data ``cd``) as locked by the receipt
 * (``skip``, ``epoch``): it holds SWA, was not skipped, was not recovered after the lock.
 * 1, 0, or -1 with an exception. */
static int
window_counts(PyObject *node, PyObject *cd, PyObject *skip, PyObject *epoch)
{
    /* ``on_device``, not ``value``: a reference to the value would touch its (cold) tensor. */
    PyObject *v = get_slot(cd, &sc_on_device);
    if (v == NULL)
        return -1;
    const int has = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (has <= 0)
        return has;
    if (skip != Py_None) {
        PyObject *id = get_slot(node, &sc_id);
        if (id == NULL)
            return -1;
        const int in = PySequence_Contains(skip, id);
        Py_DECREF(id);
        if (in != 0)
            return in < 0 ? -1 : 0;
    }
    if (epoch != Py_None) {
        PyObject *restored = get_slot(cd, &sc_restored);
        if (restored == NULL)
            return -1;
        const int le = PyObject_RichCompareBool(restored, epoch, Py_LE);
        Py_DECREF(restored);
        return le;
    }
    return 1;
}

/* The receipt's window fields: ``uuid``, ``skip`` (its skip set under the key ``index``,
 * the component type that is also the data index) and ``epoch`` as new references (all
 * None without a receipt); -1 with an exception. */
static int
receipt_fields(PyObject *params, PyObject *index, PyObject **uuid, PyObject **skip,
               PyObject **epoch)
{
    *uuid = *skip = *epoch = NULL;
    if (params == Py_None) {
        *uuid = Py_NewRef(Py_None);
        *skip = Py_NewRef(Py_None);
        *epoch = Py_NewRef(Py_None);
        return 0;
    }
    PyObject *skips = get_slot(params, &sc_r_skip);
    if (skips == NULL)
        return -1;
    if (!PyDict_Check(skips)) {
        Py_DECREF(skips);
        PyErr_SetString(PyExc_TypeError, "skip_lock_node_ids must be a dict");
        return -1;
    }
    PyObject *sk = PyDict_GetItemWithError(skips, index); /* borrowed */
    if (sk == NULL && PyErr_Occurred()) {
        Py_DECREF(skips);
        return -1;
    }
    *skip = Py_NewRef(sk == NULL ? Py_None : sk);
    Py_DECREF(skips);
    *uuid = get_slot(params, &sc_r_uuid);
    *epoch = *uuid == NULL ? NULL : get_slot(params, &sc_r_epoch);
    if (*epoch == NULL) {
        Py_CLEAR(*uuid);
        Py_CLEAR(*skip);
        return -1;
    }
    return 0;
}

/* Raise back ``ndec`` lowered counts: the nodes the walk from ``node`` counts first (the
 * counting does not read the counts, so a second walk meets the same nodes).  Keeps the
 * exception being raised. */
static void
restore_window(PyObject *node, Py_ssize_t index, PyObject *skip, PyObject *epoch,
               Py_ssize_t ndec)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    Py_INCREF(node);
    while (ndec > 0) {
        PyObject *parent = get_slot(node, &sc_parent);
        if (parent == NULL || parent == Py_None) {
            Py_XDECREF(parent);
            break;
        }
        PyObject *cd = component_data(node, index);
        const int counts = cd == NULL ? -1 : window_counts(node, cd, skip, epoch);
        if (counts > 0 && add_lock_ref(cd, 1) == 0)
            ndec--;
        Py_XDECREF(cd);
        Py_DECREF(node);
        node = parent;
        if (counts < 0)
            break;
    }
    Py_DECREF(node);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
}

/* The window walk from ``start`` (the receipt's fields unpacked): with ``locked`` (a list),
 * appends the nodes it counts and changes nothing; without, lowers their counts and returns
 * the tokens made evictable through ``*delta``.  0, or -1 with InvalidLockError (or another
 * exception) and every count as it was. */
static int
window_walk(PyObject *start, Py_ssize_t index, PyObject *uuid, PyObject *skip, PyObject *epoch,
            long long window, PyObject *locked, long long *delta)
{
    long long acc = 0;
    Py_ssize_t ndec = 0; /* counts lowered so far (``locked`` NULL) */
    PyObject *node = start, *cd = NULL, *parent = NULL;
    *delta = 0;
    Py_INCREF(node);
    for (;;) {
        parent = get_slot(node, &sc_parent);
        if (parent == NULL)
            goto fail;
        if (parent == Py_None)
            break;
        cd = component_data(node, index);
        if (cd == NULL)
            goto fail;
        const int counts = window_counts(node, cd, skip, epoch);
        if (counts < 0)
            goto fail;
        if (counts) {
            const Py_ssize_t lr = int_slot(cd, &sc_lock_ref);
            if (lr == -1 && PyErr_Occurred())
                goto fail;
            if (lr <= 0) {
                PyObject *id = get_slot(node, &sc_id);
                if (id != NULL) {
                    raise_lock_error(
                        PyUnicode_FromFormat("SWA release on node %S, which is not locked", id));
                    Py_DECREF(id);
                }
                goto fail;
            }
            const Py_ssize_t key_len = int_slot(node, &sc_key_len);
            if (key_len == -1 && PyErr_Occurred())
                goto fail;
            if (locked != NULL) {
                if (PyList_Append(locked, node) < 0)
                    goto fail;
            }
            else {
                if (set_slot(cd, &sc_lock_ref, PyLong_FromSsize_t(lr - 1)) < 0)
                    goto fail;
                ndec++;
                if (lr == 1)
                    *delta += key_len;
            }
            if (uuid == Py_None) {
                acc += key_len;
                if (acc >= window) {
                    /* Acquire would have stamped a boundary here: no receipt. */
                    raise_lock_error(PyUnicode_FromString(
                        "SWA release without the lock's swa_uuid_for_lock receipt"));
                    goto fail;
                }
            }
            else {
                PyObject *stamp = get_slot(cd, &sc_uuid);
                if (stamp == NULL)
                    goto fail;
                const int same = PyObject_RichCompareBool(stamp, uuid, Py_EQ);
                Py_DECREF(stamp);
                if (same < 0)
                    goto fail;
                if (same) {
                    Py_DECREF(cd);
                    Py_DECREF(parent);
                    Py_DECREF(node);
                    return 0;
                }
            }
        }
        Py_CLEAR(cd);
        Py_DECREF(node);
        node = parent;
        parent = NULL;
    }
    Py_CLEAR(parent);
    Py_CLEAR(node);
    if (uuid == Py_None)
        return 0;
    raise_lock_error(PyUnicode_FromFormat(
        "SWA lock receipt %S does not name a window boundary on this path", uuid));
fail:
    Py_XDECREF(cd);
    Py_XDECREF(parent);
    Py_XDECREF(node);
    if (ndec)
        restore_window(start, index, skip, epoch, ndec);
    return -1;
}

/* window_locked(node, index, params, window) -> locked   (``apply`` 0)
 * window_release(node, index, params, window) -> delta  (``apply`` 1)
 * The compiled twins of urc.components.swa_window.py_window_locked / py_window_release. */
static PyObject *
window_call(PyObject *const *args, Py_ssize_t nargs, int apply)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s(node, index, params, window)",
                     apply ? "window_release" : "window_locked");
        return NULL;
    }
    const Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    const long long window = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *uuid, *skip, *epoch;
    if (receipt_fields(args[2], args[1], &uuid, &skip, &epoch) < 0)
        return NULL;
    PyObject *locked = apply ? NULL : PyList_New(0);
    long long delta = 0;
    PyObject *res = NULL;
    if ((apply || locked != NULL) &&
        window_walk(args[0], index, uuid, skip, epoch, window, locked, &delta) == 0)
        res = apply ? PyLong_FromLongLong(delta) : Py_NewRef(locked);
    Py_XDECREF(locked);
    Py_DECREF(uuid);
    Py_DECREF(skip);
    Py_DECREF(epoch);
    return res;
}

static PyObject *
window_locked(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return window_call(args, nargs, 0);
}

static PyObject *
window_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return window_call(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(node, ck, tokens, pos, page_size) -> (nodes, pos, partial, m)"},
    {"match_tail", (PyCFunction)(void (*)(void))match_tail, METH_FASTCALL,
     "match_tail(path, rules, clock, with_values) -> (k, hit, clock, values)"},
    {"window_locked", (PyCFunction)(void (*)(void))window_locked, METH_FASTCALL,
     "window_locked(node, index, params, window) -> locked"},
    {"window_release", (PyCFunction)(void (*)(void))window_release, METH_FASTCALL,
     "window_release(node, index, params, window) -> delta"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_walk", "Compiled radix-tree walk and match tail (see urc.fastpath).", -1, methods,
};

PyMODINIT_FUNC
PyInit__walk(void)
{
    slot_cache *caches[] = {&sc_children, &sc_key,     &sc_key_len,  &sc_data,
                            &sc_full,     &sc_value,   &sc_stamp,    &sc_rule_value,
                            &sc_parent,   &sc_id,      &sc_on_device, &sc_lock_ref,
                            &sc_swa,      &sc_mamba,
                            &sc_restored, &sc_uuid,    &sc_r_uuid,   &sc_r_skip,
                            &sc_r_epoch};
    for (size_t i = 0; i < sizeof(caches) / sizeof(caches[0]); i++) {
        caches[i]->name = PyUnicode_InternFromString(caches[i]->cname);
        if (caches[i]->name == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
