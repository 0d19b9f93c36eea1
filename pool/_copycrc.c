/* Fused copy and CRC-32C: one pass over the source, the CRC taken of the very words stored.
 *
 * A verified same-node read used to copy a block (one pass over DRAM) and then checksum the
 * caller's buffer (a second pass, cache-hot): the check cost about 0.4 of the copy. Here every
 * 8-byte word is loaded once, stored to the destination and fed to the SSE4.2 crc32 instruction
 * from the same register, so the CRC covers exactly the bytes the caller receives, whatever a
 * racing writer does to the source meanwhile. Three independent CRC streams over 8 KiB runs hide
 * the instruction's 3-cycle latency; they are joined with precomputed "append 8 KiB of zeros"
 * operators (the technique of Mark Adler's crc32c.c, zlib licence, reimplemented here).
 *
 * Without SSE4.2 (or on another architecture) ``HARDWARE`` is 0 and callers use copy + crc32c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82f63b78u /* CRC-32C, reflected */
#define LONG 8192

static uint32_t zeros_long[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes (len a power of two) to a CRC register. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two bits */
    gf2_square(odd, even); /* four bits */
    do {
        gf2_square(even, odd); /* one byte, then doubling */
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t table[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        table[0][n] = gf2_times(op, n);
        table[1][n] = gf2_times(op, n << 8);
        table[2][n] = gf2_times(op, n << 16);
        table[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift_long(uint32_t crc) {
    return zeros_long[0][crc & 0xff] ^ zeros_long[1][(crc >> 8) & 0xff] ^ zeros_long[2][(crc >> 16) & 0xff] ^
           zeros_long[3][crc >> 24];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HAVE_KERNEL 1

__attribute__((target("sse4.2"))) static uint32_t copy_crc(unsigned char *dst, const unsigned char *src, size_t len,
                                                          uint32_t crc) {
    uint64_t c0 = ~crc & 0xffffffffu;
    uint64_t w0, w1, w2;
    while (len >= 3 * LONG) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = src + LONG;
        do {
            memcpy(&w0, src, 8);
            memcpy(&w1, src + LONG, 8);
            memcpy(&w2, src + 2 * LONG, 8);
            memcpy(dst, &w0, 8);
            memcpy(dst + LONG, &w1, 8);
            memcpy(dst + 2 * LONG, &w2, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
            src += 8;
            dst += 8;
        } while (src < end);
        c0 = shift_long((uint32_t)c0) ^ c1;
        c0 = shift_long((uint32_t)c0) ^ c2;
        src += 2 * LONG;
        dst += 2 * LONG;
        len -= 3 * LONG;
    }
    while (len >= 8) {
        memcpy(&w0, src, 8);
        memcpy(dst, &w0, 8);
        c0 = _mm_crc32_u64(c0, w0);
        src += 8;
        dst += 8;
        len -= 8;
    }
    while (len) {
        unsigned char b = *src++;
        *dst++ = b;
        c0 = _mm_crc32_u8((uint32_t)c0, b);
        len--;
    }
    return ~(uint32_t)c0;
}
#else
#define HAVE_KERNEL 0
#endif

static PyObject *copy_crc32c(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "w*y*|I:copy_crc32c", &dst, &src, &crc)) return NULL;
    if (dst.len < src.len || !PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "copy_crc32c: dst must be contiguous and at least as long as src");
        return NULL;
    }
#if HAVE_KERNEL
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = copy_crc((unsigned char *)dst.buf, (const unsigned char *)src.buf, (size_t)src.len, crc);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(out);
#else
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyErr_SetString(PyExc_NotImplementedError, "copy_crc32c: no hardware CRC-32C kernel on this machine");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"copy_crc32c", copy_crc32c, METH_VARARGS,
     "copy_crc32c(dst, src, crc=0) -> int: copy src into the start of dst and return the CRC-32C of the bytes "
     "stored (continuing from crc), in one pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copycrc", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copycrc(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    int hardware = 0;
#if HAVE_KERNEL
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    zeros_table(zeros_long, LONG);
    if (PyModule_AddIntConstant(m, "HARDWARE", hardware) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
