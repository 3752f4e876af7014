/*
 * kvhost._lookup: the shared lookup table's probe (kvhost.lookuptable) in C.
 *
 * The same work as LookupTable.leading in Python: SHA-256 of the
 * namespace's fingerprint (8 bytes, little-endian) followed by the key, its
 * first 8 bytes the tag and the next 8 the home slot, then linear probing.
 * Why C: a scheduler asks between other work, when the interpreter's and
 * OpenSSL's code and data are no longer in the CPU's caches; that reload,
 * not the hashing, is most of a 16-key lookup then (RATIONALE.md, "Why does
 * the Python client probe the table in C, with a Python probe beside it?").
 * This module touches a few kilobytes.
 *
 * SHA-256 uses the CPU's SHA extensions where it has them (x86-64 SHA-NI,
 * checked with CPUID at import) and portable C otherwise; digest() exposes
 * both so that tests hold each to hashlib.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVH_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* The table's format (internal/lookuptable, docs/protocol.md). */
#define HEADER_WORDS 8 /* 64 bytes */
#define SEQ_WORD 2
#define FLAGS_WORD 3
#define FLAG_MISSES_FINAL 1u
#define FLAG_INCOMPLETE 2u
#define FLAG_CLOSED 4u
#define MAX_KEY_LEN 64 /* the protocol's */
#define MAX_KEYS 4096   /* per request, the protocol's */
#define PROBE_BATCH 32  /* keys hashed before their slots are probed */

/* digest's buffer holds the fingerprint, the longest key and the padding. */
_Static_assert(8 + MAX_KEY_LEN + 9 <= 128, "a key and its padding must fit digest's two blocks");

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *data, size_t blocks);

static inline uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* compress_portable is FIPS 180-4's compression function, block by block. */
static void compress_portable(uint32_t state[8], const uint8_t *data, size_t blocks) {
    uint32_t w[64];
    for (; blocks > 0; blocks--, data += 64) {
        for (int i = 0; i < 16; i++)
            w[i] = load_be32(data + 4 * i);
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = h + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
            uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state[0] += a;
        state[1] += b;
        state[2] += c;
        state[3] += d;
        state[4] += e;
        state[5] += f;
        state[6] += g;
        state[7] += h;
    }
}

#ifdef KVH_SHA_NI
/*
 * compress_shani is the same function with the SHA extensions: the state
 * as the two registers the instructions work on (ABEF, CDGH), four rounds
 * per group of message words, the schedule extended four words at a time.
 */
__attribute__((target("sha,sse4.1"))) static void compress_shani(uint32_t state[8], const uint8_t *data,
                                                                 size_t blocks) {
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);  /* DCBA */
    __m128i st1 = _mm_loadu_si128((const __m128i *)&state[4]);  /* HGFE */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                          /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1B);                          /* EFGH */
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);                  /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);                       /* CDGH */
    for (; blocks > 0; blocks--, data += 64) {
        __m128i save0 = st0, save1 = st1;
        __m128i w[4];
        for (int g = 0; g < 16; g++) {
            __m128i m;
            if (g < 4) {
                m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * g)), swap);
            } else {
                /* W[g] = msg2(msg1(W[g-4], W[g-3]) + W[g-2..g-1] shifted by one word, W[g-1]) */
                __m128i w4 = w[g & 3], w3 = w[(g + 1) & 3], w2 = w[(g + 2) & 3], w1 = w[(g + 3) & 3];
                m = _mm_add_epi32(_mm_sha256msg1_epu32(w4, w3), _mm_alignr_epi8(w1, w2, 4));
                m = _mm_sha256msg2_epu32(m, w1);
            }
            w[g & 3] = m;
            __m128i k = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K[4 * g]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, k);
            st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(k, 0x0E));
        }
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);       /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);       /* DCHG */
    st0 = _mm_blend_epi16(tmp, st1, 0xF0);    /* DCBA */
    st1 = _mm_alignr_epi8(st1, tmp, 8);       /* HGFE */
    _mm_storeu_si128((__m128i *)&state[0], st0);
    _mm_storeu_si128((__m128i *)&state[4], st1);
}

static int cpu_has_shani(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & bit_SHA) != 0;
}
#endif

/* The compression function chosen at import. */
static compress_fn best_compress = compress_portable;

/* digest writes SHA-256(fp as 8 little-endian bytes || key) to out; key is
 * at most MAX_KEY_LEN bytes, so the message and its padding fit 2 blocks. */
static void digest(compress_fn compress, uint64_t fp, const uint8_t *key, size_t n, uint8_t out[32]) {
    uint8_t buf[128];
    size_t len = 8 + n;
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(fp >> (8 * i));
    memcpy(buf + 8, key, n);
    size_t blocks = len + 9 <= 64 ? 1 : 2;
    memset(buf + len, 0, 64 * blocks - len);
    buf[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++)
        buf[64 * blocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    uint32_t st[8];
    memcpy(st, H0, sizeof st);
    compress(st, buf, blocks);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(st[i] >> 24);
        out[4 * i + 1] = (uint8_t)(st[i] >> 16);
        out[4 * i + 2] = (uint8_t)(st[i] >> 8);
        out[4 * i + 3] = (uint8_t)st[i];
    }
}

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* key_bytes gives a key's bytes: bytes directly, anything else through
 * the buffer protocol (released by the caller when *view is set). */
static int key_bytes(PyObject *key, const uint8_t **p, Py_ssize_t *n, Py_buffer *view, int *held) {
    *held = 0;
    if (PyBytes_Check(key)) {
        *p = (const uint8_t *)PyBytes_AS_STRING(key);
        *n = PyBytes_GET_SIZE(key);
    } else {
        if (PyObject_GetBuffer(key, view, PyBUF_SIMPLE) < 0)
            return -1;
        *held = 1;
        *p = view->buf;
        *n = view->len;
    }
    if (*n < 1 || *n > MAX_KEY_LEN) {
        PyErr_Format(PyExc_ValueError, "key of %zd bytes: want 1..%d", *n, MAX_KEY_LEN);
        if (*held)
            PyBuffer_Release(view);
        *held = 0;
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(leading_doc,
             "leading(table, shift, fp, keys) -> (n, final) or None\n\n"
             "The shared lookup table's probe: table is the whole mapped file (a\n"
             "buffer), shift its slots' log2 (0..30), fp the namespace's fingerprint, keys a\n"
             "list of keys. n leading keys are held; final says the next key is not\n"
             "stored either. None: the table cannot answer now (closed, or being\n"
             "rebuilt); ask the daemon. keys: a sequence of bytes-like keys; their\n"
             "number and byte lengths are checked as the daemon checks them\n"
             "(ValueError); fp must fit 64 bits (OverflowError).");

/* key_seq returns keys as a sequence whose items stay alive and in place
 * for the whole probe: a list of bytes itself (nothing the probe calls
 * runs Python code, so nothing can change it meanwhile), otherwise a
 * tuple (a key that is not bytes has Python code behind its buffer, which
 * could change a list under the probe). Anything but a list or tuple is
 * copied into one; what is not a sequence (an iterator) is refused, as
 * len() refuses it in the Python probe. A new reference, or NULL. */
static PyObject *key_seq(PyObject *keys) {
    if (PyTuple_CheckExact(keys)) {
        Py_INCREF(keys);
        return keys;
    }
    if (PyList_CheckExact(keys)) {
        Py_ssize_t n = PyList_GET_SIZE(keys);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyBytes_CheckExact(PyList_GET_ITEM(keys, i)))
                return PyList_AsTuple(keys);
        }
        Py_INCREF(keys);
        return keys;
    }
    if (!PySequence_Check(keys) || PyIter_Check(keys)) {
        PyErr_Format(PyExc_TypeError, "keys must be a sequence, not %.100s", Py_TYPE(keys)->tp_name);
        return NULL;
    }
    return PySequence_Tuple(keys);
}

/* check_table checks the table's buffer for 2^shift slots. */
static int check_table(const Py_buffer *tb, unsigned int shift) {
    if (shift >= 31) { /* the callers checked it */
        PyErr_Format(PyExc_ValueError, "a table of 2^%u slots", shift);
        return -1;
    }
    if ((uint64_t)tb->len < 8 * HEADER_WORDS + ((uint64_t)8 << shift)) {
        PyErr_Format(PyExc_ValueError, "a table of 2^%u slots in %zd bytes: it needs %llu", shift, tb->len,
                     (unsigned long long)(8 * HEADER_WORDS + ((uint64_t)8 << shift)));
        return -1;
    }
    if ((uintptr_t)tb->buf % 8 != 0) { /* a mapping is page-aligned */
        PyErr_SetString(PyExc_ValueError, "the table's buffer is not 8-byte aligned");
        return -1;
    }
    return 0;
}

/* A digest source gives the first 16 bytes of key i's SHA-256(fp || key):
 * hashed from the key (keys_source) or read from digests the caller made
 * once (digests_source). It returns -1 with an error set. */
typedef int (*digest_fn)(void *src, Py_ssize_t i, uint8_t out[16]);

struct keys_source {
    PyObject **items;
    uint64_t fp;
};

static int keys_source(void *src, Py_ssize_t i, uint8_t out[16]) {
    struct keys_source *ks = src;
    const uint8_t *kp;
    Py_ssize_t kn;
    Py_buffer view;
    int held;
    if (key_bytes(ks->items[i], &kp, &kn, &view, &held) < 0)
        return -1;
    uint8_t d[32];
    digest(best_compress, ks->fp, kp, (size_t)kn, d);
    if (held)
        PyBuffer_Release(&view);
    memcpy(out, d, 16);
    return 0;
}

static int digests_source(void *src, Py_ssize_t i, uint8_t out[16]) {
    memcpy(out, (const uint8_t *)src + 16 * i, 16);
    return 0;
}

/* probe_slots is the probe itself, over count keys whose digests next
 * gives: a new reference to (n, final) or None, or NULL with an error set. */
static PyObject *probe_slots(const Py_buffer *tb, unsigned int shift, Py_ssize_t count, digest_fn next, void *src) {
    const uint64_t *header = tb->buf;
    const uint64_t *slots = header + HEADER_WORDS;
    const uint64_t mask = ((uint64_t)1 << shift) - 1;
    /* The daemon moves keys between slots between an odd sequence and the
     * next even one; a probe that sees the same even sequence before and
     * after read no such move. Adds and removes of single slots and the
     * flags are written outside that window, each a word at a time: the
     * flags are loaded once, here, before the probe. */
    uint64_t seq = __atomic_load_n(&header[SEQ_WORD], __ATOMIC_ACQUIRE);
    uint64_t flags = __atomic_load_n(&header[FLAGS_WORD], __ATOMIC_ACQUIRE);
    if ((seq & 1) || (flags & FLAG_CLOSED))
        Py_RETURN_NONE;
    Py_ssize_t n = count;
    /* Keys are hashed a batch at a time and their home slots prefetched
     * before the first is probed, so that the batch's cache misses on the
     * table overlap instead of following one another. */
    uint64_t tags[PROBE_BATCH], homes[PROBE_BATCH];
    for (Py_ssize_t base = 0; base < count && n == count; base += PROBE_BATCH) {
        Py_ssize_t batch = count - base < PROBE_BATCH ? count - base : PROBE_BATCH;
        for (Py_ssize_t b = 0; b < batch; b++) {
            uint8_t d[16];
            if (next(src, base + b, d) < 0)
                return NULL;
            tags[b] = load_le64(d);
            if (tags[b] <= 1)
                tags[b] += 2;
            homes[b] = load_le64(d + 8) & mask;
            __builtin_prefetch(&slots[homes[b]]);
        }
        for (Py_ssize_t b = 0; b < batch; b++) {
            uint64_t tag = tags[b], j = homes[b];
            uint64_t v = __atomic_load_n(&slots[j], __ATOMIC_RELAXED);
            for (uint64_t probes = 0; v != tag && v != 0 && probes <= mask; probes++) {
                j = (j + 1) & mask;
                v = __atomic_load_n(&slots[j], __ATOMIC_RELAXED);
            }
            if (v != tag) {
                n = base + b;
                break;
            }
        }
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&header[SEQ_WORD], __ATOMIC_ACQUIRE) != seq)
        Py_RETURN_NONE;
    int final = (flags & (FLAG_MISSES_FINAL | FLAG_INCOMPLETE)) == FLAG_MISSES_FINAL;
    return Py_BuildValue("(nO)", n, final ? Py_True : Py_False);
}

/* probe is leading's work on the table's buffer and the keys (a list or
 * tuple from key_seq), which the caller holds and releases: a new
 * reference, or NULL with an error set. */
static PyObject *probe(const Py_buffer *tb, unsigned int shift, uint64_t fp, PyObject *keys) {
    if (check_table(tb, shift) < 0)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(keys);
    /* Every key is checked as the daemon would, by its bytes, before the
     * first probe (the answer may stop at the first miss). */
    if (count < 1 || count > MAX_KEYS) {
        PyErr_Format(PyExc_ValueError, "%zd keys: want 1..%d", count, MAX_KEYS);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint8_t *kp;
        Py_ssize_t kn;
        Py_buffer view;
        int held;
        if (key_bytes(items[i], &kp, &kn, &view, &held) < 0)
            return NULL;
        if (held)
            PyBuffer_Release(&view);
    }
    struct keys_source ks = {items, fp};
    return probe_slots(tb, shift, count, keys_source, &ks);
}

/* parse_shift reads the slots' log2, 0..30 as the format allows: checked
 * here, not wrapped to an unsigned int (format "I" would take 2^32 + 10
 * for 10). */
static int parse_shift(PyObject *shifto, unsigned int *shift) {
    int overflow;
    long long sh = PyLong_AsLongLongAndOverflow(shifto, &overflow);
    if (sh == -1 && PyErr_Occurred())
        return -1;
    if (overflow || sh < 0 || sh > 30) {
        PyErr_Format(PyExc_ValueError, "shift %R: want 0..30 (the log2 of the table's slots)", shifto);
        return -1;
    }
    *shift = (unsigned int)sh;
    return 0;
}

static PyObject *leading(PyObject *self, PyObject *args) {
    Py_buffer table;
    PyObject *shifto, *fpo, *keys;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*OOO", &table, &shifto, &fpo, &keys))
        return NULL;
    unsigned int shift;
    if (parse_shift(shifto, &shift) < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    /* The fingerprint is a u64: a negative or larger one is refused, as
     * struct.pack("<Q") refuses it in the Python probe. */
    unsigned long long fp = PyLong_AsUnsignedLongLong(fpo);
    if (fp == (unsigned long long)-1 && PyErr_Occurred()) {
        PyBuffer_Release(&table);
        return NULL;
    }
    keys = key_seq(keys);
    if (keys == NULL) {
        PyBuffer_Release(&table);
        return NULL;
    }
    PyObject *result = probe(&table, shift, fp, keys);
    Py_DECREF(keys);
    PyBuffer_Release(&table);
    return result;
}

PyDoc_STRVAR(leading_digests_doc,
             "leading_digests(table, shift, digests) -> (n, final) or None\n\n"
             "leading's probe over keys hashed once: digests holds, per key, the\n"
             "first 16 bytes of digest(fp, key), key after key (1..4096 keys).");

static PyObject *leading_digests(PyObject *self, PyObject *args) {
    Py_buffer table, digests;
    PyObject *shifto;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Oy*", &table, &shifto, &digests))
        return NULL;
    PyObject *result = NULL;
    unsigned int shift;
    if (parse_shift(shifto, &shift) == 0 && check_table(&table, shift) == 0) {
        Py_ssize_t count = digests.len / 16;
        if (digests.len % 16 != 0 || count < 1 || count > MAX_KEYS)
            PyErr_Format(PyExc_ValueError, "%zd bytes of digests: want 16 per key, 1..%d keys", digests.len,
                         MAX_KEYS);
        else
            result = probe_slots(&table, shift, count, digests_source, digests.buf);
    }
    PyBuffer_Release(&digests);
    PyBuffer_Release(&table);
    return result;
}

PyDoc_STRVAR(digest_doc,
             "digest(fp, key, portable=False) -> bytes\n\n"
             "SHA-256 of fp (8 bytes, little-endian) followed by key, by the\n"
             "compression this module chose at import, or by its portable C one.");

static PyObject *py_digest(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fp", "key", "portable", NULL};
    unsigned long long fp;
    PyObject *key;
    int portable = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KO|p", names, &fp, &key, &portable))
        return NULL;
    const uint8_t *kp;
    Py_ssize_t kn;
    Py_buffer view;
    int held;
    if (key_bytes(key, &kp, &kn, &view, &held) < 0)
        return NULL;
    uint8_t d[32];
    digest(portable ? compress_portable : best_compress, fp, kp, (size_t)kn, d);
    if (held)
        PyBuffer_Release(&view);
    return PyBytes_FromStringAndSize((const char *)d, 32);
}

static PyMethodDef methods[] = {
    {"leading", leading, METH_VARARGS, leading_doc},
    {"leading_digests", leading_digests, METH_VARARGS, leading_digests_doc},
    {"digest", (PyCFunction)(void (*)(void))py_digest, METH_VARARGS | METH_KEYWORDS, digest_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvhost._lookup",
    .m_doc = "The shared lookup table's probe in C (see kvhost.lookuptable).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__lookup(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    const char *sha = "portable";
#ifdef KVH_SHA_NI
    if (cpu_has_shani()) {
        best_compress = compress_shani;
        sha = "sha-ni";
    }
#endif
    if (PyModule_AddStringConstant(m, "SHA256", sha) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
