/* urc._native._pages: the compiled twins of urc.pools.pageops.py_count_held / py_release /
 * py_release_held / py_take / py_unmap / py_claim (see their docstrings).  They work on numpy arrays
 * through the buffer protocol: ``state`` int8 (one entry per page); ``lo`` and ``len`` int64
 * (the token allocator's free extents), ``stack`` int64 (the SWA page pool's free pages) and
 * ``idx`` int64; ``idx`` may be strided (a sliced tensor's host view), and
 * ``idx[start:end]`` is used.  No Python code runs inside them. */
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

/* count_pages and do_release get an AVX2 clone beside the baseline one, picked at load time
 * where GCC can (x86-64 Linux): twice the lanes for their run tests, a quarter to a third
 * less time on a 62k-78k-slot value.  (max_of's four chains are faster without it.) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define WIDE_LOOPS __attribute__((target_clones("avx2", "default")))
#else
#define WIDE_LOOPS
#endif

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

/* How many of the contiguous pages ``pages[0, n)`` are allocated; ``*bad`` is set when one is
 * outside [0, num_pages).  No early exit and a clamped load, so the loop has no branch on
 * the data beyond the run tests. */
WIDE_LOOPS static long long
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

/* The largest of ``v[0, n)`` (0 when empty), in four independent chains: a 64-bit compare
 * does not vectorize on baseline x86-64, and one chain waits on each compare. */
static unsigned long long
max_of(const unsigned long long *v, Py_ssize_t n)
{
    unsigned long long m0 = 0, m1 = 0, m2 = 0, m3 = 0;
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        m0 = v[i] > m0 ? v[i] : m0;
        m1 = v[i + 1] > m1 ? v[i + 1] : m1;
        m2 = v[i + 2] > m2 ? v[i + 2] : m2;
        m3 = v[i + 3] > m3 ? v[i + 3] : m3;
    }
    for (; i < n; i++)
        m0 = v[i] > m0 ? v[i] : m0;
    m0 = m1 > m0 ? m1 : m0;
    m2 = m3 > m2 ? m3 : m2;
    return m2 > m0 ? m2 : m0;
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
        const unsigned long long ub = (unsigned long long)bound;
        if (stride == 8) { /* contiguous: the usual value */
            bad = n > 0 && max_of((const unsigned long long *)ip, n) >= ub;
        }
        else {
            for (Py_ssize_t i = 0; i < n; i++)
                bad |= (unsigned long long)(*(const long long *)(ip + i * stride)) >= ub;
        }
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

/* The free list of the token allocator: a stack of extents, ``lo[e]`` and ``len[e]`` for
 * ``e < next``, each the free pages ``[lo, lo + len)``.  A free pushes the maximal runs of
 * consecutive pages of what it frees (in order); an allocation takes pages from the top
 * extent up (ascending within each).  A value is mostly such runs, so a free writes a few
 * extents instead of one entry per page. */
typedef struct {
    Py_buffer lo_buf, len_buf;
    long long *lo, *len;
    Py_ssize_t cap, next;
} Extents;

/* ``lo``, ``len`` (contiguous int64 arrays of one size) and ``next`` at args[0..2]. */
static int
get_extents(PyObject *const *args, Extents *x)
{
    x->next = PyLong_AsSsize_t(args[2]);
    if (x->next == -1 && PyErr_Occurred())
        return -1;
    if (get_1d(args[0], &x->lo_buf, 8, 1, "lo") < 0)
        return -1;
    if (get_1d(args[1], &x->len_buf, 8, 1, "len") < 0) {
        PyBuffer_Release(&x->lo_buf);
        return -1;
    }
    x->cap = x->lo_buf.shape[0];
    if (x->lo_buf.strides[0] != 8 || x->len_buf.strides[0] != 8 ||
        x->len_buf.shape[0] != x->cap || x->next < 0 || x->next > x->cap) {
        PyErr_SetString(PyExc_ValueError,
                        "lo and len: contiguous, of one size, and 0 <= next <= their size");
        PyBuffer_Release(&x->len_buf);
        PyBuffer_Release(&x->lo_buf);
        return -1;
    }
    x->lo = (long long *)x->lo_buf.buf;
    x->len = (long long *)x->len_buf.buf;
    return 0;
}

static void
release_extents(Extents *x)
{
    PyBuffer_Release(&x->len_buf);
    PyBuffer_Release(&x->lo_buf);
}

/* True when the states of pages [lo, lo + n) are all ``byte``. */
static int
states_all_n(const signed char *state, unsigned long long lo, unsigned long long n,
             unsigned long long byte)
{
    const signed char *s = state + lo;
    unsigned long long k = 0;
    for (; k + BLK <= n; k += BLK)
        if (!states_all(s + k, BLK, byte))
            return 0;
    for (; k < n; k++)
        if ((unsigned long long)(unsigned char)s[k] != byte)
            return 0;
    return 1;
}

/* True when ``p[0, n)`` is p[0], p[0] + 1, ... (a branch-free loop the compiler vectorizes). */
static inline int
ascending(const unsigned long long *p, int n)
{
    const unsigned long long p0 = p[0];
    unsigned long long off = 0;
    for (int k = 0; k < n; k++)
        off |= (p[k] - (unsigned long long)k) ^ p0;
    return off == 0;
}

/* release(state, lo, len, next, idx, start, end, step, shift) -> new next; with
 * ``need_held``, release_held: -1 (nothing changed) unless every page is allocated.
 *
 * One pass over the pages cuts them into extents, written above ``next`` (free space until
 * ``next`` moves) and checked for range; only then are states read or cleared, per extent:
 * nothing changes on an error.  Extents per call: at most one per page; the first one
 * joins the top extent when it continues it. */
WIDE_LOOPS static PyObject *
do_release(PyObject *const *args, Py_ssize_t nargs, int need_held)
{
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "%s(state, lo, len, next, idx, start, end, step, shift)",
                     need_held ? "release_held" : "release");
        return NULL;
    }
    Py_buffer st;
    if (get_1d(args[0], &st, 1, 1, "state") < 0)
        return NULL;
    Extents x;
    if (get_extents(args + 1, &x) < 0) {
        PyBuffer_Release(&st);
        return NULL;
    }
    Idx ix;
    Py_ssize_t step, shift;
    if (parse_common(args + 4, &ix, &step, &shift) < 0) {
        release_extents(&x);
        PyBuffer_Release(&st);
        return NULL;
    }
    const Py_ssize_t count = (ix.n + step - 1) / step;
    /* Locals, not the buffer structs: a store through a pointer could alias them. */
    const char *ip = ix.base;
    const Py_ssize_t istride = ix.stride * step;
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    signed char *const state = (signed char *)st.buf;
    long long *const xlo = x.lo, *const xlen = x.len;
    const Py_ssize_t cap = x.cap, next = x.next;
    Py_ssize_t e = next; /* extents cut so far end at e (counted past cap too) */
    unsigned long long bad = 0;
    PyObject *res = NULL;
#define PAGE(i) ((unsigned long long)(*(const long long *)(ip + (i) * istride) >> shift))
#define PUSH(a, b)                                                                          \
    do {                                                                                    \
        bad |= (a) >= num_pages || (b) > num_pages || (b) <= (a);                           \
        if (e < cap) {                                                                      \
            xlo[e] = (long long)(a);                                                        \
            xlen[e] = (long long)((b) - (a));                                               \
        }                                                                                   \
        e++;                                                                                \
    } while (0)
/* The next page: it extends the extent or starts the next one. */
#define STEP(page)                                                                          \
    do {                                                                                    \
        const unsigned long long q = (page);                                                \
        if (q == end) {                                                                     \
            end++;                                                                          \
        }                                                                                   \
        else {                                                                              \
            PUSH(lo, end);                                                                  \
            lo = q;                                                                         \
            end = q + 1;                                                                    \
        }                                                                                   \
    } while (0)
    if (count > 0) {
        unsigned long long lo = PAGE(0), end = lo + 1; /* the extent [lo, end) being cut */
        Py_ssize_t i = 1;
        if (istride == 8 && shift == 0) {
            const unsigned long long *const pages = (const unsigned long long *)ip;
            while (i < count) {
                /* A block continuing the extent: the usual case, one vector test. */
                if (i + BLK <= count && pages[i] == end && ascending(pages + i, BLK)) {
                    end += BLK;
                    i += BLK;
                    continue;
                }
                STEP(pages[i]);
                i++;
            }
        }
        else {
            for (; i < count; i++)
                STEP(PAGE(i));
        }
        PUSH(lo, end);
    }
#undef STEP
#undef PUSH
#undef PAGE
    if (e > cap) {
        PyErr_SetString(PyExc_ValueError, "release: more extents than the free list holds");
        goto done;
    }
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "release: page out of range");
        goto done;
    }
    /* Each extent is checked (held: state 1) just before it is cleared, so a page repeated
     * in the call is free when its second extent is checked; on a failure the extents
     * cleared so far are restored: nothing changed. */
    for (Py_ssize_t k = next; k < e; k++) {
        if (need_held &&
            !states_all_n(state, (unsigned long long)xlo[k], (unsigned long long)xlen[k], 1)) {
            for (Py_ssize_t r = next; r < k; r++)
                memset(state + xlo[r], 1, (size_t)xlen[r]);
            res = PyLong_FromLong(-1);
            goto done;
        }
        memset(state + xlo[k], 0, (size_t)xlen[k]);
    }
    /* The first extent continues the top one (pages freed in the order they were taken):
     * one extent, so that freeing spans one by one leaves what freeing them at once does. */
    if (next > 0 && e > next && xlo[next] == xlo[next - 1] + xlen[next - 1]) {
        xlen[next - 1] += xlen[next];
        memmove(xlo + next, xlo + next + 1, (size_t)(e - next - 1) * sizeof(long long));
        memmove(xlen + next, xlen + next + 1, (size_t)(e - next - 1) * sizeof(long long));
        e--;
    }
    res = PyLong_FromSsize_t(e);
done:
    release_idx(&ix);
    release_extents(&x);
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

/* take(state, lo, len, next, out) -> new next
 * Fill ``out`` (int64, contiguous) with free pages from the top extent down, ascending within
 * each, and mark them allocated; ``ValueError`` (nothing changed) when the extents hold fewer
 * pages than ``out`` or one of them is out of range. */
static PyObject *
take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "take(state, lo, len, next, out)");
        return NULL;
    }
    Py_buffer st, ob;
    if (get_1d(args[0], &st, 1, 1, "state") < 0)
        return NULL;
    Extents x;
    if (get_extents(args + 1, &x) < 0) {
        PyBuffer_Release(&st);
        return NULL;
    }
    if (get_1d(args[4], &ob, 8, 1, "out") < 0) {
        release_extents(&x);
        PyBuffer_Release(&st);
        return NULL;
    }
    PyObject *res = NULL;
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    const Py_ssize_t need = ob.shape[0];
    long long *const out = (long long *)ob.buf;
    signed char *const state = (signed char *)st.buf;
    long long *const xlo = x.lo, *const xlen = x.len;
    if (ob.strides[0] != 8) {
        PyErr_SetString(PyExc_TypeError, "take: out must be contiguous");
        goto done;
    }
    /* Check the extents the take reaches before changing anything. */
    Py_ssize_t e = x.next, have = 0;
    while (have < need && e > 0) {
        e--;
        const unsigned long long a = (unsigned long long)xlo[e], n = (unsigned long long)xlen[e];
        if (a >= num_pages || n == 0 || n > num_pages - a) {
            PyErr_SetString(PyExc_ValueError, "take: an extent out of range");
            goto done;
        }
        have += (Py_ssize_t)n;
    }
    if (have < need) {
        PyErr_SetString(PyExc_ValueError, "take: fewer free pages than asked for");
        goto done;
    }
    e = x.next;
    Py_ssize_t filled = 0;
    while (filled < need) {
        const long long a = xlo[e - 1], n = xlen[e - 1];
        const long long t = n < need - filled ? n : need - filled;
        for (long long k = 0; k < t; k++)
            out[filled + k] = a + k;
        memset(state + a, 1, (size_t)t);
        filled += t;
        if (t == n) {
            e--;
        }
        else {
            xlo[e - 1] = a + t;
            xlen[e - 1] = n - t;
        }
    }
    res = PyLong_FromSsize_t(e);
done:
    PyBuffer_Release(&ob);
    release_extents(&x);
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

/* Move the contiguous pages ``pages[0, n)`` from state ``from`` to ``to``, runs of BLK pages
 * as one block; returns how many moved before the first page out of range (``*bad`` set) or
 * not in ``from`` (``n`` when all did).  The range is checked as it goes: a separate pass
 * (64-bit compares do not vectorize on baseline x86-64) would cost more than the claim. */
WIDE_LOOPS static Py_ssize_t
claim_pages(signed char *state, unsigned long long num_pages, const unsigned long long *pages,
            Py_ssize_t n, signed char from, signed char to, int *bad)
{
    const unsigned long long from_byte = (unsigned long long)(unsigned char)from;
    Py_ssize_t i = 0;
    /* One ascending run (a fresh allocation, the usual value): one test, one memset. */
    if (n >= BLK && n <= 0x7fffffff && pages[0] < num_pages && pages[n - 1] < num_pages &&
        pages[n - 1] - pages[0] == (unsigned long long)(n - 1) && ascending(pages, (int)n) &&
        states_all_n(state, pages[0], (unsigned long long)n, from_byte)) {
        memset(state + pages[0], to, (size_t)n);
        return n;
    }
    while (i < n) {
        if (i + BLK <= n) {
            const unsigned long long lo = run_low_n(pages + i, BLK);
            if (lo != NO_RUN && num_pages >= BLK && lo <= num_pages - BLK &&
                states_all(state + lo, BLK, from_byte)) {
                memset(state + lo, to, BLK);
                i += BLK;
                continue;
            }
        }
        const unsigned long long p = pages[i];
        if (p >= num_pages) {
            *bad = 1;
            break;
        }
        if (state[p] != from)
            break;
        state[p] = to;
        i++;
    }
    return i;
}

/* claim(state, idx, start, end, step, shift, bound, frm, to) -> int
 * Move the pages idx[start:end][::step] >> shift from state ``frm`` to state ``to``; returns
 * how many.  -1: a page outside [0, len(state)) (or, with bound >= 0, an entry of the span
 * outside [0, bound)); -2: a page not in state ``frm``, or one that occurs twice (its second
 * occurrence finds it in state ``to``).  Nothing changes on -1 or -2: the range is checked
 * first, and the pages moved before a failure are moved back. */
static PyObject *
claim(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "claim(state, idx, start, end, step, shift, bound, frm, to)");
        return NULL;
    }
    const long long bound = PyLong_AsLongLong(args[6]);
    const long frm = PyLong_AsLong(args[7]);
    const long to = PyLong_AsLong(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (frm < 0 || frm > 127 || to < 0 || to > 127 || frm == to) {
        PyErr_SetString(PyExc_ValueError, "claim: 0 <= frm, to <= 127 and frm != to");
        return NULL;
    }
    Py_buffer st;
    if (get_1d(args[0], &st, 1, 1, "state") < 0)
        return NULL;
    Idx ix;
    Py_ssize_t step, shift;
    if (parse_common(args + 1, &ix, &step, &shift) < 0) {
        PyBuffer_Release(&st);
        return NULL;
    }
    signed char *const state = (signed char *)st.buf;
    const unsigned long long num_pages = (unsigned long long)st.shape[0];
    const char *const ip = ix.base;
    const Py_ssize_t stride = ix.stride;
    const Py_ssize_t n = ix.n;
    const Py_ssize_t count = (n + step - 1) / step;
    const Py_ssize_t pstride = stride * step;
    const signed char from_b = (signed char)frm, to_b = (signed char)to;
    long long res = 0;
    unsigned long long bad = 0;
    if (bound >= 0) {
        const unsigned long long ub = (unsigned long long)bound;
        if (stride == 8)
            bad = n > 0 && max_of((const unsigned long long *)ip, n) >= ub;
        else
            for (Py_ssize_t i = 0; i < n; i++)
                bad |= (unsigned long long)(*(const long long *)(ip + i * stride)) >= ub;
    }
#define CPAGE(i) ((unsigned long long)(*(const long long *)(ip + (i) * pstride) >> shift))
    if (pstride != 8 || shift != 0) /* (page 1, contiguous: checked as it claims) */
        for (Py_ssize_t i = 0; i < count && !bad; i++)
            bad |= CPAGE(i) >= num_pages;
    if (bad) {
        res = -1;
        goto done;
    }
    Py_ssize_t i = 0;
    int out_of_range = 0;
    if (pstride == 8 && shift == 0) {
        i = claim_pages(state, num_pages, (const unsigned long long *)ip, count, from_b, to_b,
                        &out_of_range);
    }
    else {
        for (; i < count; i++) {
            const unsigned long long p = CPAGE(i);
            if (state[p] != from_b)
                break;
            state[p] = to_b;
        }
    }
    if (i < count) {
        /* Move back what moved: pages [0, i) are distinct (a repeat stops the loop). */
        for (Py_ssize_t r = 0; r < i; r++)
            state[CPAGE(r)] = from_b;
        /* Out of range anywhere wins over a state (the twin checks the range first). */
        for (Py_ssize_t r = i; r < count && !out_of_range; r++)
            out_of_range = CPAGE(r) >= num_pages;
        res = out_of_range ? -1 : -2;
    }
    else {
        res = count;
    }
#undef CPAGE
done:
    release_idx(&ix);
    PyBuffer_Release(&st);
    return PyLong_FromLongLong(res);
}

static PyMethodDef methods[] = {
    {"claim", (PyCFunction)(void (*)(void))claim, METH_FASTCALL,
     "claim(state, idx, start, end, step, shift, bound, frm, to) -> int"},
    {"count_held", (PyCFunction)(void (*)(void))count_held, METH_FASTCALL,
     "count_held(state, idx, start, end, step, shift, bound) -> int"},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "release(state, lo, len, next, idx, start, end, step, shift) -> int"},
    {"release_held", (PyCFunction)(void (*)(void))release_held, METH_FASTCALL,
     "release_held(state, lo, len, next, idx, start, end, step, shift) -> int"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(state, lo, len, next, out) -> int"},
    {"unmap", (PyCFunction)(void (*)(void))unmap, METH_FASTCALL,
     "unmap(map, state, stack, top, idx, start, end, step, shift) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pages", "Compiled page bookkeeping (see urc.pools.pageops).", -1, methods,
};

PyMODINIT_FUNC
PyInit__pages(void)
{
    return PyModule_Create(&module);
}
