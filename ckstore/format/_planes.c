/* Byte planes in C: the split and merge of ckstore's byte-plane codec (ckstore/format/codec.py).

A chunk of n elements of k bytes has k planes of n bytes each; plane j holds byte j of every
element, plane[j][i] == chunk[i * k + j] (docs/format.md, "Chunk frames"). split() cuts a chunk
into its planes and merge() interleaves planes back into a chunk, each in one pass over the
chunk: numpy's strided copies make k passes (one per plane) and ran at ~3 GB/s on one thread of
the development machine, these at 19-42 GB/s for 2- and 4-byte elements and 5-9 GB/s for 8-byte
ones (docs/benchmarks.md, "Byte planes").

Both check every length and that no output overlaps an input before touching memory, and
release the GIL while they copy: checkout's read threads decode chunks side by side. Elements of
2, 4 and 8 bytes are moved as whole little-endian words (the compiler vectorizes these loops;
on x86-64 with glibc an AVX2 copy is also built and picked at load time); other sizes, and
big-endian machines, take a byte loop over blocks of elements. The layout is the same on every
machine, and the same as numpy's ``raw[j::k]``, which ckstore falls back to without this module.

Built by hatch_build.py into the wheel, or in place for an editable install; optional.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MAX_PLANES 16 /* a frame's plane mask has 16 bits */

#if defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__x86_64__) && defined(__GLIBC__)
#define CK_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CK_CLONES
#define CK_CLONES
#endif

#if (defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) || defined(_WIN32)
#define CK_WORDS 1
#else
#define CK_WORDS 0
#endif

/* -- kernels: src/dst is the chunk, p[j] the planes, n elements ------------------------------ */

#if CK_WORDS
CK_CLONES static void merge2(uint8_t *restrict dst, const uint8_t *restrict p0,
                             const uint8_t *restrict p1, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t w = (uint16_t)(p0[i] | (uint16_t)p1[i] << 8);
        memcpy(dst + 2 * i, &w, 2);
    }
}

CK_CLONES static void merge4(uint8_t *restrict dst, const uint8_t *restrict p0,
                             const uint8_t *restrict p1, const uint8_t *restrict p2,
                             const uint8_t *restrict p3, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t w = (uint32_t)p0[i] | (uint32_t)p1[i] << 8 | (uint32_t)p2[i] << 16 |
                     (uint32_t)p3[i] << 24;
        memcpy(dst + 4 * i, &w, 4);
    }
}

CK_CLONES static void merge8(uint8_t *restrict dst, const uint8_t *const *p, size_t n) {
    const uint8_t *restrict p0 = p[0], *restrict p1 = p[1], *restrict p2 = p[2],
                            *restrict p3 = p[3], *restrict p4 = p[4], *restrict p5 = p[5],
                            *restrict p6 = p[6], *restrict p7 = p[7];
    for (size_t i = 0; i < n; i++) {
        uint64_t w = (uint64_t)p0[i] | (uint64_t)p1[i] << 8 | (uint64_t)p2[i] << 16 |
                     (uint64_t)p3[i] << 24 | (uint64_t)p4[i] << 32 | (uint64_t)p5[i] << 40 |
                     (uint64_t)p6[i] << 48 | (uint64_t)p7[i] << 56;
        memcpy(dst + 8 * i, &w, 8);
    }
}

CK_CLONES static void split2(const uint8_t *restrict src, uint8_t *restrict p0,
                             uint8_t *restrict p1, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t w;
        memcpy(&w, src + 2 * i, 2);
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
    }
}

CK_CLONES static void split4(const uint8_t *restrict src, uint8_t *restrict p0,
                             uint8_t *restrict p1, uint8_t *restrict p2, uint8_t *restrict p3,
                             size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t w;
        memcpy(&w, src + 4 * i, 4);
        p0[i] = (uint8_t)w;
        p1[i] = (uint8_t)(w >> 8);
        p2[i] = (uint8_t)(w >> 16);
        p3[i] = (uint8_t)(w >> 24);
    }
}

/* Transposes the 8x8 byte matrix x[row] byte col into x[col] byte row: the off-diagonal
   4x4, then 2x2, then 1x1 blocks swapped in place. */
static inline void transpose8x8(uint64_t *x) {
    for (int r = 0; r < 4; r++) {
        uint64_t t = ((x[r] >> 32) ^ x[r + 4]) & 0x00000000FFFFFFFFull;
        x[r + 4] ^= t;
        x[r] ^= t << 32;
    }
    for (int b = 0; b < 8; b += 4) {
        for (int r = b; r < b + 2; r++) {
            uint64_t t = ((x[r] >> 16) ^ x[r + 2]) & 0x0000FFFF0000FFFFull;
            x[r + 2] ^= t;
            x[r] ^= t << 16;
        }
    }
    for (int r = 0; r < 8; r += 2) {
        uint64_t t = ((x[r] >> 8) ^ x[r + 1]) & 0x00FF00FF00FF00FFull;
        x[r + 1] ^= t;
        x[r] ^= t << 8;
    }
}

/* 8 elements at a time as one 8x8 transpose (moving each byte by shifts, as merge8 does,
   vectorized poorly: 2.6 against 4.6 GB/s) */
CK_CLONES static void split8(const uint8_t *restrict src, uint8_t *const *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x[8];
        memcpy(x, src + 8 * i, sizeof x);
        transpose8x8(x);
        for (int j = 0; j < 8; j++) memcpy(p[j] + i, &x[j], 8);
    }
    for (; i < n; i++)
        for (int j = 0; j < 8; j++) p[j][i] = src[8 * i + j];
}
#endif

/* Any element size: a block of elements at a time, so the chunk's block stays in cache while
   each plane's bytes are copied into or out of it. */
#define BLOCK 4096

static void merge_bytes(uint8_t *dst, const uint8_t *const *p, size_t k, size_t n) {
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t end = n - start < BLOCK ? n : start + BLOCK;
        for (size_t j = 0; j < k; j++) {
            const uint8_t *plane = p[j];
            for (size_t i = start; i < end; i++) dst[i * k + j] = plane[i];
        }
    }
}

static void split_bytes(const uint8_t *src, uint8_t *const *p, size_t k, size_t n) {
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t end = n - start < BLOCK ? n : start + BLOCK;
        for (size_t j = 0; j < k; j++) {
            uint8_t *plane = p[j];
            for (size_t i = start; i < end; i++) plane[i] = src[i * k + j];
        }
    }
}

static void merge_planes(uint8_t *dst, const uint8_t *const *p, size_t k, size_t n) {
#if CK_WORDS
    switch (k) {
    case 2: merge2(dst, p[0], p[1], n); return;
    case 4: merge4(dst, p[0], p[1], p[2], p[3], n); return;
    case 8: merge8(dst, p, n); return;
    }
#endif
    merge_bytes(dst, p, k, n);
}

static void split_planes(const uint8_t *src, uint8_t *const *p, size_t k, size_t n) {
#if CK_WORDS
    switch (k) {
    case 2: split2(src, p[0], p[1], n); return;
    case 4: split4(src, p[0], p[1], p[2], p[3], n); return;
    case 8: split8(src, p, n); return;
    }
#endif
    split_bytes(src, p, k, n);
}

/* -- argument handling ---------------------------------------------------------------------- */

typedef struct {
    Py_buffer chunk;
    Py_buffer planes[MAX_PLANES];
    Py_ssize_t k;     /* planes acquired so far */
    int has_chunk;
} Views;

static void release(Views *v) {
    for (Py_ssize_t j = 0; j < v->k; j++) PyBuffer_Release(&v->planes[j]);
    if (v->has_chunk) PyBuffer_Release(&v->chunk);
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    const char *x = a->buf, *y = b->buf;
    return a->len && b->len && x < y + b->len && y < x + a->len;
}

/* Acquire the chunk (writable for merge) and the k planes (writable for split), contiguous,
   and check that each plane holds len(chunk) / k bytes and that no output overlaps an input.
   Returns the element count, or -1 with an exception set (and nothing left acquired). */
static Py_ssize_t acquire(Views *v, PyObject *chunk, PyObject *planes, int merging) {
    memset(v, 0, sizeof(*v));
    /* a tuple of its own: acquiring a buffer may run code that changes a list it was given */
    PyObject *seq = PySequence_Tuple(planes);
    if (seq == NULL) return -1;
    Py_ssize_t k = PyTuple_GET_SIZE(seq);
    if (k < 2 || k > MAX_PLANES) {
        PyErr_Format(PyExc_ValueError, "byte planes come 2 to %d at a time, got %zd", MAX_PLANES, k);
        goto fail;
    }
    if (PyObject_GetBuffer(chunk, &v->chunk, merging ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) goto fail;
    v->has_chunk = 1;
    if (v->chunk.len % k) {
        PyErr_Format(PyExc_ValueError, "a chunk of %zd bytes does not hold whole %zd-byte elements",
                     v->chunk.len, k);
        goto fail;
    }
    Py_ssize_t n = v->chunk.len / k;
        for (Py_ssize_t j = 0; j < k; j++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, j), &v->planes[j], merging ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
            goto fail;
        v->k = j + 1;
        if (v->planes[j].len != n) {
            PyErr_Format(PyExc_ValueError, "byte plane %zd holds %zd bytes, expected %zd", j,
                         v->planes[j].len, n);
            goto fail;
        }
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        int bad = overlaps(&v->chunk, &v->planes[j]);
        for (Py_ssize_t i = 0; !merging && !bad && i < j; i++) bad = overlaps(&v->planes[i], &v->planes[j]);
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "byte planes and their chunk must not overlap");
            goto fail;
        }
    }
    Py_DECREF(seq);
    return n;
fail:
    Py_DECREF(seq);
    release(v);
    return -1;
}

PyDoc_STRVAR(merge_doc,
"merge(planes, chunk)\n--\n\n"
"Interleave k byte planes (a list of k buffers of n bytes) into chunk, a writable buffer of\n"
"n * k bytes: chunk[i * k + j] = planes[j][i]. Releases the GIL while it copies.");

/* merge() and split(): the buffers checked, then the copy with the GIL released. */
static PyObject *run(PyObject *args, int merging) {
    PyObject *first, *second;
    if (!PyArg_ParseTuple(args, merging ? "OO:merge" : "OO:split", &first, &second)) return NULL;
    PyObject *planes = merging ? first : second, *chunk = merging ? second : first;
    Views v;
    Py_ssize_t n = acquire(&v, chunk, planes, merging);
    if (n < 0) return NULL;
    uint8_t *p[MAX_PLANES];
    for (Py_ssize_t j = 0; j < v.k; j++) p[j] = v.planes[j].buf;
    Py_BEGIN_ALLOW_THREADS
    if (merging)
        merge_planes(v.chunk.buf, (const uint8_t *const *)p, (size_t)v.k, (size_t)n);
    else
        split_planes(v.chunk.buf, p, (size_t)v.k, (size_t)n);
    Py_END_ALLOW_THREADS
    release(&v);
    Py_RETURN_NONE;
}

static PyObject *merge(PyObject *Py_UNUSED(self), PyObject *args) { return run(args, 1); }

PyDoc_STRVAR(split_doc,
"split(chunk, planes)\n--\n\n"
"Cut chunk, a buffer of n * k bytes, into k byte planes (a list of k writable buffers of n\n"
"bytes): planes[j][i] = chunk[i * k + j]. Releases the GIL while it copies.");

static PyObject *split(PyObject *Py_UNUSED(self), PyObject *args) { return run(args, 0); }

static PyMethodDef methods[] = {
    {"merge", merge, METH_VARARGS, merge_doc},
    {"split", split, METH_VARARGS, split_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_planes",
    "Byte planes in C: split and merge for ckstore's byte-plane codec.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
