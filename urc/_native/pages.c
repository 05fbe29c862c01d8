/* urc._native._pages: the compiled twins of urc.pageops.py_count_held / py_release /
 * py_release_held / py_unmap (see their docstrings).  They work on numpy arrays through the
 * buffer protocol: ``state`` int8 (one entry per page), ``stack`` and ``idx`` int64; ``idx``
 * may be strided (a sliced tensor's host view), and ``idx[start:end]`` is used.  No Python
 * code runs inside them.
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

/* Page 1 values are mostly runs of consecutive slots, ascending (a fresh stack) or
 * descending (pages pushed by a free and popped back).  A block of pages that is such a run
 * reads or clears its page states as 8-byte words instead of one byte at a time; the run
 * test is a loop without branches that the compiler vectorizes.  Blocks of BLK pages are
 * tried first, then blocks of RUN (a value whose runs are short: pages freed and popped
 * back in small groups).
 *
 *   block pages[i, i + len)        lowest page   state bytes touched
 *   p, p + 1, ..., p + len - 1     p             [p, p + len)
 *   p, p - 1, ..., p - len + 1     p - len + 1   [p - len + 1, p + 1)
 *
 * Returns the lowest page of the run, or -1 (as unsigned: ~0) when the block is not one.
 * Negative pages wrap to huge unsigned values, so a run through page -1 lands out of range
 * and the caller's range check rejects it. */
enum { RUN = 8, BLK = 64 };
#define NO_RUN (~0ULL)

static inline unsigned long long
run_low_n(const unsigned long long *p, int len)
{
    const unsigned long long p0 = p[0];
    const unsigned long long d = p[1] - p0; /* 1 or ~0 (-1) in a run */
    unsigned long long off = 0;
    if (d == 1) {
        for (int k = 0; k < len; k++)
            off |= (p[k] - (unsigned long long)k) ^ p0;
        return off ? NO_RUN : p0;
    }
    if (d == ~0ULL) {
        for (int k = 0; k < len; k++)
            off |= (p[k] + (unsigned long long)k) ^ p0;
        return off ? NO_RUN : p0 - (unsigned long long)(len - 1);
    }
    return NO_RUN;
}

static inline unsigned long long
run_low(const unsigned long long *p)
{
    return run_low_n(p, RUN);
}

/* True when the ``len`` (a multiple of 8) state bytes at ``s`` all hold ``byte``. */
static inline int
states_all(const signed char *s, int len, unsigned long long byte)
{
    const unsigned long long want = byte * 0x0101010101010101ULL;
    unsigned long long off = 0;
    for (int k = 0; k < len; k += 8) {
        unsigned long long word;
        memcpy(&word, s + k, 8);
        off |= word ^ want;
    }
    return off == 0;
}

/* Copies ``src[0:n)`` to ``dst`` (which must not overlap it) and says whether any entry
 * is outside [0, lim), for 0 < lim < 2^63, in the same pass.  ``v | (lim - 1 - v)`` has its
 * top bit set exactly for those (a negative entry, or one past the limit): a subtract and an
 * or per entry, which the compiler vectorizes (a 64-bit unsigned compare has no SSE2
 * instruction, so a plain ``v >= lim`` loop stays scalar). */
static inline int
copy_out_of_range(unsigned long long *restrict dst, const unsigned long long *restrict src,
                  Py_ssize_t n, unsigned long long lim)
{
    unsigned long long acc = 0;
    const unsigned long long last = lim - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned long long v = src[i];
        dst[i] = v;
        acc |= v | (last - v);
    }
    return n > 0 && (lim == 0 || (acc >> 63) != 0);
}

/* How many of the contiguous pages ``pages[0, n)`` are allocated; ``*bad`` is set when one is
 * outside [0, num_pages).  No early exit and a clamped load, so the loop has no branch on
 * the data beyond the run tests. */
static long long
count_pages(const signed char *state, unsigned long long num_pages,
            const unsigned long long *pages, Py_ssize_t n, unsigned long long *bad_out)
{
    long long held = 0;
    unsigned long long bad = 0;
    Py_ssize_t i = 0;
    while (i < n) {
        if (i + BLK <= n) {
            const unsigned long long lo = run_low_n(pages + i, BLK);
            if (lo != NO_RUN && num_pages >= BLK && lo <= num_pages - BLK &&
                states_all(state + lo, BLK, 1)) {
                held += BLK;
                i += BLK;
                continue;
            }
        }
        /* Not one run: by RUN sub-blocks, then one page at a time. */
        const Py_ssize_t end = i + BLK <= n ? i + BLK : n;
        for (; i + RUN <= end; i += RUN) {
            const unsigned long long lo = run_low(pages + i);
            if (lo != NO_RUN && num_pages >= RUN && lo <= num_pages - RUN &&
                states_all(state + lo, RUN, 1)) {
                held += RUN;
                continue;
            }
            for (Py_ssize_t j = i; j < i + RUN; j++) {
                const unsigned long long p = pages[j];
                const unsigned long long in = p < num_pages;
                bad |= in ^ 1;
                held += state[in ? p : 0] != 0;
            }
        }
        for (; i < end; i++) {
            const unsigned long long p = pages[i];
            const unsigned long long in = p < num_pages;
            bad |= in ^ 1;
            held += state[in ? p : 0] != 0;
        }
    }
    *bad_out |= bad;
    return held;
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
        /* Page 1, a contiguous span (the usual value). */
        held = count_pages(state, num_pages, (const unsigned long long *)ip, n, &bad);
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

/* release(state, stack, top, idx, start, end, step, shift) -> new top; with
 * ``need_held``, release_held: -1 (nothing changed) unless every page is allocated. */
static PyObject *
do_release(PyObject *const *args, Py_ssize_t nargs, int need_held)
{
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "%s(state, stack, top, idx, start, end, step, shift)",
                     need_held ? "release_held" : "release");
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
    /* One pass writes the pages onto the stack above ``top`` (scratch space until ``top``
     * moves) and checks their range; only then are the states cleared, from the copy (a
     * contiguous run of pages whatever the stride): nothing changes when a page is out of
     * range. */
    unsigned long long *const pages = (unsigned long long *)(stack + top);
    unsigned long long bad = 0;
    if (istride == 8 && shift == 0) {
        bad = copy_out_of_range(pages, (const unsigned long long *)ip, count, num_pages);
    }
    else {
        for (Py_ssize_t i = 0; i < count; i++) {
            const unsigned long long p =
                (unsigned long long)(*(const long long *)(ip + i * istride) >> shift);
            pages[i] = p;
            bad |= p >= num_pages;
        }
    }
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "release: page out of range");
        goto done;
    }
    /* The allocation check reads the staged copy (contiguous, just written), not ``idx``. */
    if (need_held && count_pages(state, num_pages, pages, count, &bad) != count) {
        res = PyLong_FromLong(-1);
        goto done;
    }
    /* Runs are in range: every page was checked above. */
    Py_ssize_t i = 0;
    while (i < count) {
        if (i + BLK <= count) {
            const unsigned long long lo = run_low_n(pages + i, BLK);
            if (lo != NO_RUN) {
                memset(state + lo, 0, BLK);
                i += BLK;
                continue;
            }
        }
        const Py_ssize_t end = i + BLK <= count ? i + BLK : count;
        for (; i + RUN <= end; i += RUN) {
            const unsigned long long lo = run_low(pages + i);
            if (lo != NO_RUN) {
                memset(state + lo, 0, RUN);
                continue;
            }
            for (Py_ssize_t j = i; j < i + RUN; j++)
                state[pages[j]] = 0;
        }
        for (; i < end; i++)
            state[pages[i]] = 0;
    }
    res = PyLong_FromSsize_t(top + count);
done:
    release_idx(&ix);
    PyBuffer_Release(&sk);
    PyBuffer_Release(&st);
    return res;
}

static PyObject *
release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_release(args, nargs, 0);
}

static PyObject *
release_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return do_release(args, nargs, 1);
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
    {"release_held", (PyCFunction)(void (*)(void))release_held, METH_FASTCALL,
     "release_held(state, stack, top, idx, start, end, step, shift) -> int"},
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
