/* The fused CPU step of trie_decode: masking logits rows and advancing trie nodes in one pass over each row.
 *
 * Why this exists: on a CPU the vectorized numpy/torch path costs a few dozen array operations per step (a ragged
 * gather of the kept (row, token) pairs, a take, a fill, a put); at batch 64 that fixed cost is several times the
 * physical floor, the fill(-inf) of the logits. This kernel does, per row, what the reference loop of
 * trie_decode/kernels/__init__.py says, in one pass: -inf over the gaps between the row's kept columns (or a copy through
 * the dense row's blocked columns). In place it only writes, like the floor itself. On CPUs with AVX-512, rows that
 * keep many columns (wide nodes, dense rows) take the bitmap pass instead (bits_row): one masked copy per 64 columns.
 *
 * It is optional: trie_decode/kernels/native.py loads it when it was compiled and falls back to the numpy/torch path
 * otherwise (and always on CUDA and MPS). Both paths read the same step table and are tested against each other.
 *
 * The rules it applies are stated elsewhere, once: what a row keeps in the step table (trie_decode/spans.py), the
 * floor given to rows another processor emptied in trie_decode/kernels/rules.py (applied here by floor_rule), the
 * filters as per-node bits (trie_decode/filters.py). This file only applies them.
 *
 * Memory safety: the Python wrapper passes raw data pointers (packed int64 fields, see read_fields) of arrays whose
 * dtype, contiguity and shape it has checked; this file additionally bounds-checks every node id and token it reads
 * from per-step state, so a corrupt state can give a wrong mask but never an out-of-bounds access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

/* Step table columns (trie_decode/spans.py). */
enum { T_START, T_COUNT, T_SLOT, T_ANCHOR, T_EXTRA0, T_EXTRA1, T_ON_TOKEN, T_ON_MATCH, T_OTHERWISE, T_COLS };

/* The filter bits per (filter, node): the filter rule as data, defined and computed in trie_decode/filters.py
 * (CHILD_EXCLUDED, END_EXCLUDED, filter_bits); exported below so that a test checks both sides agree. */
enum { CHILD_EXCLUDED = 1, END_EXCLUDED = 2 };

/* The row functions are compiled for AVX-512, AVX2 and the baseline, and picked at load time: filling is the
 * floor of masking and must run at the speed of torch's own vectorized fill. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define TD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TD_CLONES
#endif

static inline uint64_t load_bits(const char *p, int es) {
    if (es == 4) return *(const uint32_t *)p;
    if (es == 2) return *(const uint16_t *)p;
    return *(const uint64_t *)p;
}

static inline void store_bits(char *p, int es, uint64_t v) {
    if (es == 4) *(uint32_t *)p = (uint32_t)v;
    else if (es == 2) *(uint16_t *)p = (uint16_t)v;
    else *(uint64_t *)p = v;
}

/* Write the -inf pattern over nb bytes at d (nb a multiple of es). pat holds 64 bytes of the pattern. Blocks of
 * 64 or 16 bytes, the last one overlapping back into the gap, so a short gap costs a store or two, not a loop
 * with a scalar tail (a row of 256 kept columns has 257 gaps); long float32 runs go to wmemset. */
static inline void fill_gap(char *d, size_t nb, const char *pat, int es, uint64_t bits) {
    size_t i = 0;
#if WCHAR_MAX > 0xFFFF
    if (es == 4 && nb >= 1024) {  /* libc's wmemset: as fast as torch's fill on long runs */
        wmemset((wchar_t *)d, (wchar_t)(uint32_t)bits, nb / 4);
        return;
    }
#endif
    if (nb >= 64) {
        for (; i + 64 <= nb; i += 64) memcpy(d + i, pat, 64);
        if (i < nb) memcpy(d + nb - 64, pat, 64);
    } else if (nb >= 16) {
        for (; i + 16 <= nb; i += 16) memcpy(d + i, pat, 16);
        if (i < nb) memcpy(d + nb - 16, pat, 16);
    } else {
        for (; i < nb; i += (size_t)es) store_bits(d + i, es, bits);
    }
}

/* A sparse row: -inf over the gaps between the ascending kept columns cols[0..k). In place (drow == srow) the
 * kept values are not touched, so the row is only written, like the floor's fill; otherwise they are copied. */
TD_CLONES static void sparse_row(char *drow, const char *srow, const int64_t *cols, Py_ssize_t k, Py_ssize_t width,
                                 int es, uint64_t bits, const char *pat) {
    Py_ssize_t prev = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t col = (Py_ssize_t)cols[j];
        fill_gap(drow + prev * es, (size_t)(col - prev) * es, pat, es, bits);
        if (drow != srow) store_bits(drow + col * es, es, load_bits(srow + col * es, es));
        prev = col + 1;
    }
    fill_gap(drow + prev * es, (size_t)(width - prev) * es, pat, es, bits);
}

/* The floor rule, applied to one masked row once its kept columns are written. The rule is stated once, in
 * trie_decode/kernels/rules.py (floor_rule), with the value it writes (ALL_MASKED_FLOOR, passed in as floor_bits);
 * every kernel applies it, and this function is the C kernel's one application of it:
 *   a row that keeps nothing (a filter left it no usable column) keeps the end token, at the floor;
 *   a row whose kept values are all -inf (another processor banned them) gets the floor in every kept column.
 * The kept columns are cols[0..k), the children's tokens ctok[0..nc) below vm, and, for a dense row (brow not NULL),
 * every column j < vm with brow[j] == 0. done_row is the step table's row of DONE, whose anchor is the end token
 * (read only when needed: it is often out of cache). */
static void floor_rule(char *drow, const int64_t *cols, Py_ssize_t k, const int32_t *ctok, Py_ssize_t nc,
                       const uint8_t *brow, Py_ssize_t vm, const int32_t *done_row, Py_ssize_t width, int es,
                       uint64_t neg_bits, uint64_t floor_bits) {
    Py_ssize_t j;
    int none = k == 0 && !brow;
    for (j = 0; none && j < nc; j++) none = !(ctok[j] >= 0 && ctok[j] < vm);
    if (none) {
        const int64_t end_token = done_row[T_ANCHOR];
        if (end_token >= 0 && end_token < width) store_bits(drow + (Py_ssize_t)end_token * es, es, floor_bits);
        return;
    }
    for (j = 0; j < k; j++)
        if (load_bits(drow + cols[j] * es, es) != neg_bits) return;
    for (j = 0; j < nc; j++)
        if (ctok[j] >= 0 && ctok[j] < vm && load_bits(drow + (Py_ssize_t)ctok[j] * es, es) != neg_bits) return;
    if (brow)
        for (j = 0; j < vm; j++)
            if (!brow[j] && load_bits(drow + j * es, es) != neg_bits) return;
    for (j = 0; j < k; j++) store_bits(drow + cols[j] * es, es, floor_bits);
    for (j = 0; j < nc; j++)
        if (ctok[j] >= 0 && ctok[j] < vm) store_bits(drow + (Py_ssize_t)ctok[j] * es, es, floor_bits);
    if (brow)
        for (j = 0; j < vm; j++)
            if (!brow[j]) store_bits(drow + j * es, es, floor_bits);
}

/* A dense row: dst[j] = blocked[j] ? -inf : src[j] for j < vt, -inf up to the width (dst may equal src). */
TD_CLONES static void dense_row(char *dst, const char *src, const uint8_t *blocked, Py_ssize_t vt, Py_ssize_t width,
                                int es, uint64_t bits, const char *pat) {
    Py_ssize_t j;
    if (es == 4) {
        uint32_t v = (uint32_t)bits, *d = (uint32_t *)dst;
        const uint32_t *s = (const uint32_t *)src;
        for (j = 0; j < vt; j++) d[j] = blocked[j] ? v : s[j];
    } else if (es == 2) {
        uint16_t v = (uint16_t)bits, *d = (uint16_t *)dst;
        const uint16_t *s = (const uint16_t *)src;
        for (j = 0; j < vt; j++) d[j] = blocked[j] ? v : s[j];
    } else {
        uint64_t v = bits, *d = (uint64_t *)dst;
        const uint64_t *s = (const uint64_t *)src;
        for (j = 0; j < vt; j++) d[j] = blocked[j] ? v : s[j];
    }
    fill_gap(dst + vt * es, (size_t)(width - vt) * es, pat, es, bits);
}

/* Insert col into the ascending array cols[0..*k) unless it is there already (cols has room for one more). */
static void insert_sorted(int64_t *cols, Py_ssize_t *k, int64_t col) {
    Py_ssize_t lo = 0, hi = *k;
    while (lo < hi) {
        Py_ssize_t mid = lo + ((hi - lo) >> 1);
        if (cols[mid] < col) lo = mid + 1;
        else hi = mid;
    }
    if (lo < *k && cols[lo] == col) return;
    memmove(cols + lo + 1, cols + lo, (size_t)(*k - lo) * sizeof(int64_t));
    cols[lo] = col;
    (*k)++;
}

/* The table row of a state code: nodes index their own row, codes -K..-1 the K rows after the N node rows; any
 * other value (a corrupt state) reads the last row, code -1 (DONE: only the end token). */
static const int32_t *table_row(const int32_t *table, int64_t node, int64_t num_nodes, int64_t num_codes) {
    int64_t r;
    if (node >= 0 && node < num_nodes) r = node;
    else if (node < 0 && node >= -num_codes) r = num_nodes + num_codes + node;
    else r = num_nodes + num_codes - 1;
    return table + r * T_COLS;
}

/* True when every filter has its flags (flags[f] not NULL) and every row's filter index is in [0, num_filters);
 * else a ValueError or an IndexError is set. */
static int filters_in_range(const uint8_t *const *flags, Py_ssize_t num_filters, const int64_t *filt, Py_ssize_t n) {
    for (Py_ssize_t f = 0; f < num_filters; f++)
        if (!flags[f]) {
            PyErr_Format(PyExc_ValueError, "filter %zd has no flags", f);
            return 0;
        }
    for (Py_ssize_t i = 0; i < n; i++)
        if (filt[i] < 0 || filt[i] >= num_filters) {
            PyErr_Format(PyExc_IndexError, "row %zd names filter %lld of %zd", i, (long long)filt[i], num_filters);
            return 0;
        }
    return 1;
}

/* The call boundary. Each entry point takes two bytes objects of packed int64 fields (native-endian, made by
 * struct.pack in trie_decode/kernels/native.py from the field names listed there, whose lengths this module
 * exports so that the two sides cannot drift apart):
 *   trie: the step table and the trie, packed once per step table (TRIE_FIELDS);
 *   job:  what changes per call: the logits, the rows' states, the filters (MASK_FIELDS, CHILD_FIELDS,
 *         STEP_FIELDS; MASK_FIELDS and STEP_FIELDS start with the LOGITS_FIELDS).
 * Pointers are data addresses of arrays whose dtype, contiguity and shape the Python side has checked. */
enum { TF_TABLE, TF_NUM_NODES, TF_NUM_CODES, TF_CHILD_TOKEN, TF_CHILD_PTR, TF_BLOCKED, TF_VOCAB, TF_NUM_DENSE, TF_BITS,
       TF_NUM_BITS, TF_WIDE_NODES, TF_NUM_WIDE, TF_COUNT };
enum { LF_OUT, LF_SRC, LF_BATCH, LF_OUT_STRIDE, LF_SRC_STRIDE, LF_WIDTH, LF_ELSIZE, LF_NEG_BITS, LF_FLOOR_BITS,
       LF_COUNT };
enum { MF_N = LF_COUNT, MF_ROWS, MF_NODES, MF_FLAGS, MF_FILTER, MF_NUM_FILTERS, MF_COUNT };
enum { SF_NODES = LF_COUNT, SF_TOKENS, SF_TOKEN_STRIDE, SF_PARENTS, SF_PARENT_STRIDE, SF_PARENT_SIZE, SF_MOVES, SF_FLAGS,
       SF_FILTER, SF_NUM_FILTERS, SF_COUNT };
/* step()'s per-call fields, which may follow its job as arguments (the rest of a job stays the same from call to
 * call: the caller packs it once) */
enum { STEP_CALL_COUNT = 6 };
static const int STEP_CALL_FIELDS[STEP_CALL_COUNT] = {LF_OUT, LF_SRC, SF_TOKENS, SF_TOKEN_STRIDE, SF_PARENTS,
                                                      SF_PARENT_STRIDE};
enum { CF_OUT, CF_NODES, CF_TOKENS, CF_N, CF_MOVES, CF_FLAGS, CF_FILTER, CF_NUM_FILTERS, CF_COUNT };

/* Copy the count int64 fields packed in a bytes object into f; 0 with a TypeError set when it is not exactly
 * that. */
static int read_fields(PyObject *packed, int64_t *f, Py_ssize_t count, const char *what) {
    if (!PyBytes_Check(packed) || PyBytes_GET_SIZE(packed) != count * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes of %zd packed int64 fields", what, count);
        return 0;
    }
    memcpy(f, PyBytes_AS_STRING(packed), (size_t)count * sizeof(int64_t));
    return 1;
}

/* One masking call: the logits geometry, the rows' states, the step table and the trie (see py_mask). */
typedef struct {
    char *out;
    const char *src;
    Py_ssize_t batch, out_stride, src_stride, width;
    int es;
    uint64_t neg_bits, floor_bits;
    Py_ssize_t n, row_base;  /* without a row map (rows NULL), state row i masks logits row row_base + i */
    const int64_t *rows, *nodes;
    const int32_t *table;
    Py_ssize_t num_nodes, num_codes;
    const int32_t *child_token;
    Py_ssize_t num_children;
    const uint8_t *blocked;
    /* The bitmap pass's rows ((vt + 63) / 64 words each, bit 1: kept), or NULL: the num_dense dense rows, then one
     * per wide node, the nodes wide_nodes[0..num_wide) (ascending); num_bits rows in all. */
    const uint64_t *bits;
    Py_ssize_t num_bits, num_wide;
    const int64_t *wide_nodes;
    Py_ssize_t vt, num_dense;
    const int32_t *child_ptr;
    const uint8_t *const *flags;  /* per filter, its (num_nodes,) flags; NULL: no filters */
    const int64_t *filt;
    Py_ssize_t num_filters;
} MaskJob;

/* A MaskJob from the packed trie fields and the logits fields at the start of a job's fields (rows, nodes and
 * filters are left empty for the caller). */
static void mask_job_init(MaskJob *j, const int64_t *tf, const int64_t *lf) {
    j->out = (char *)(intptr_t)lf[LF_OUT], j->src = (const char *)(intptr_t)lf[LF_SRC];
    j->batch = (Py_ssize_t)lf[LF_BATCH], j->out_stride = (Py_ssize_t)lf[LF_OUT_STRIDE];
    j->src_stride = (Py_ssize_t)lf[LF_SRC_STRIDE], j->width = (Py_ssize_t)lf[LF_WIDTH], j->es = (int)lf[LF_ELSIZE];
    j->neg_bits = (uint64_t)lf[LF_NEG_BITS], j->floor_bits = (uint64_t)lf[LF_FLOOR_BITS];
    j->n = 0, j->row_base = 0, j->rows = NULL, j->nodes = NULL;
    j->table = (const int32_t *)(intptr_t)tf[TF_TABLE];
    j->num_nodes = (Py_ssize_t)tf[TF_NUM_NODES], j->num_codes = (Py_ssize_t)tf[TF_NUM_CODES];
    j->child_token = (const int32_t *)(intptr_t)tf[TF_CHILD_TOKEN], j->num_children = j->num_nodes;
    j->blocked = (const uint8_t *)(intptr_t)tf[TF_BLOCKED];
    j->vt = (Py_ssize_t)tf[TF_VOCAB], j->num_dense = (Py_ssize_t)tf[TF_NUM_DENSE];
    j->bits = (const uint64_t *)(intptr_t)tf[TF_BITS], j->num_bits = (Py_ssize_t)tf[TF_NUM_BITS];
    j->wide_nodes = (const int64_t *)(intptr_t)tf[TF_WIDE_NODES], j->num_wide = (Py_ssize_t)tf[TF_NUM_WIDE];
    j->child_ptr = (const int32_t *)(intptr_t)tf[TF_CHILD_PTR];
    j->flags = NULL, j->filt = NULL, j->num_filters = 0;
}

/* The job's checks, with the GIL held: 0 with an exception set when it is inconsistent. */
static int mask_job_check(const MaskJob *j) {
    if (!j->table || !j->child_token || !j->child_ptr || j->num_nodes < 1 || (j->num_dense > 0 && !j->blocked)) {
        PyErr_SetString(PyExc_ValueError, "the packed trie fields lack the step table or the trie arrays");
        return 0;
    }
    if (j->n < 0 || (j->n > 0 && !j->nodes)) {
        PyErr_SetString(PyExc_ValueError, "the job lacks the rows' nodes");
        return 0;
    }
    if (j->flags && (!j->filt || j->num_filters < 1)) {
        PyErr_SetString(PyExc_ValueError, "filter flags need each row's filter");
        return 0;
    }
    if (j->flags && !filters_in_range(j->flags, j->num_filters, j->filt, j->n)) return 0;
    if (j->es != 2 && j->es != 4 && j->es != 8) {
        PyErr_Format(PyExc_ValueError, "element size must be 2, 4 or 8 bytes, got %d", j->es);
        return 0;
    }
    if (j->vt < 0 || (j->batch > 1 && (j->width > j->out_stride || j->width > j->src_stride)) || j->num_codes < 1) {
        PyErr_SetString(PyExc_ValueError, "inconsistent logits geometry or step table");
        return 0;
    }
    if (j->rows) {
        for (Py_ssize_t i = 0; i < j->n; i++)
            if (j->rows[i] < 0 || j->rows[i] >= j->batch) {
                PyErr_Format(PyExc_IndexError, "logits row %lld is outside the batch of %zd rows", (long long)j->rows[i],
                             j->batch);
                return 0;
            }
    } else if (j->row_base < 0 || j->n > j->batch - j->row_base) {
        PyErr_Format(PyExc_IndexError, "%zd states for a batch of %zd logits rows", j->row_base + j->n, j->batch);
        return 0;
    }
    return 1;
}

/* The bitmap pass (x86-64 with AVX-512, picked at run time): a row's kept columns as one bit each, and one pass that
 * writes the whole row, each 64-column word a masked load of the kept values over -inf. Its cost does not depend on
 * how many columns the row keeps or where they lie, and it stays within a few percent of the fill: the gap loop
 * (sparse_row) pays per gap (a node with hundreds of children has hundreds of short gaps) and the dense row's select
 * (dense_row) reads a byte per column besides the row. The bitmaps of dense rows and of wide nodes (many children)
 * are built once per trie (the trie fields bits and wide_nodes, native.py, kernel_bits); other rows with many kept
 * columns get theirs built here, shared by consecutive rows in one state. */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define TD_BITS 1
#define TD_AVX512 __attribute__((target("avx512f,avx512bw")))

/* Whether this CPU (and its OS) runs AVX-512F/BW; asked once. */
static int bits_supported(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    }
    return known;
}

/* drow[c] = bit c of bits ? srow[c] : -inf for c < cols, -inf from cols to width (drow may equal srow; bits has
 * (cols + 63) / 64 words). */
TD_AVX512 static void bits_row(char *drow, const char *srow, const uint64_t *bits, Py_ssize_t cols, Py_ssize_t width,
                               int es, uint64_t neg, const char *pat) {
    const Py_ssize_t full = cols / 64;
    Py_ssize_t w, c;
    if (es == 4) {
        const __m512i v = _mm512_set1_epi32((int)(uint32_t)neg);
        for (w = 0; w < full; w++) {
            uint64_t k = bits[w];
            char *d = drow + w * 256;
            const char *s = srow + w * 256;
            if (!k) {
                for (int q = 0; q < 4; q++) _mm512_storeu_si512(d + 64 * q, v);
            } else {
                for (int q = 0; q < 4; q++)
                    _mm512_storeu_si512(d + 64 * q, _mm512_mask_loadu_epi32(v, (__mmask16)(k >> (16 * q)), s + 64 * q));
            }
        }
    } else if (es == 2) {
        const __m512i v = _mm512_set1_epi16((short)(uint16_t)neg);
        for (w = 0; w < full; w++) {
            uint64_t k = bits[w];
            char *d = drow + w * 128;
            const char *s = srow + w * 128;
            _mm512_storeu_si512(d, _mm512_mask_loadu_epi16(v, (__mmask32)k, s));
            _mm512_storeu_si512(d + 64, _mm512_mask_loadu_epi16(v, (__mmask32)(k >> 32), s + 64));
        }
    } else {
        const __m512i v = _mm512_set1_epi64((long long)neg);
        for (w = 0; w < full; w++) {
            uint64_t k = bits[w];
            char *d = drow + w * 512;
            const char *s = srow + w * 512;
            for (int q = 0; q < 8; q++)
                _mm512_storeu_si512(d + 64 * q, _mm512_mask_loadu_epi64(v, (__mmask8)(k >> (8 * q)), s + 64 * q));
        }
    }
    for (c = full * 64; c < cols; c++)
        store_bits(drow + c * es, es, (bits[c >> 6] >> (c & 63)) & 1 ? load_bits(srow + c * es, es) : neg);
    if (cols < width) fill_gap(drow + cols * es, (size_t)(width - cols) * es, pat, es, neg);
}
#endif

/* A sparse row keeps its columns' bits in a bitmap from this many kept columns on (below, the gap loop is as fast
 * and needs no bitmap). */
#define BITS_MIN_KEPT 64

/* The scratch memory of masking, shared by the jobs of one call: the kept columns of a state (cap of them) and its
 * bitmap (words words, the logits' width). */
typedef struct {
    int64_t *keep_col;
    Py_ssize_t cap;
    uint64_t *bits;
    Py_ssize_t words;
} Workspace;

/* 0 when out of memory (free it with workspace_free either way). */
static int workspace_init(Workspace *ws, Py_ssize_t width) {
    ws->cap = 256, ws->words = (width + 63) / 64;
    ws->keep_col = (int64_t *)malloc((size_t)ws->cap * sizeof(int64_t));
    ws->bits = (uint64_t *)malloc((size_t)(ws->words > 0 ? ws->words : 1) * sizeof(uint64_t));
    return ws->keep_col && ws->bits;
}

static void workspace_free(Workspace *ws) {
    free(ws->keep_col), free(ws->bits);
    ws->keep_col = NULL, ws->bits = NULL;
}

/* The masking itself (no GIL needed; run after mask_job_check): the number of rows masked, or -1 when out of
 * memory. ws: scratch for logits of the job's width (workspace_init).
 *
 * Per row: its kept columns (the children of its node that its filter leaves, then its extras: anchor, end token,
 * separator), -inf everywhere else, then the floor rule (floor_rule) over what it keeps. A dense node without a
 * filter keeps the unblocked columns of its dense row instead of a list of children; under a filter its children
 * are listed from the CSR range like any node's (the filter drops some of them). Consecutive rows in the same
 * state (node and filter) share what is derived from it: the kept columns, and the bitmap. */
static Py_ssize_t mask_job_work(const MaskJob *j, Workspace *ws) {
    char *out = j->out;
    const char *src = j->src;
    const Py_ssize_t out_stride = j->out_stride, src_stride = j->src_stride, width = j->width, n = j->n;
    const Py_ssize_t num_nodes = j->num_nodes, num_codes = j->num_codes, num_children = j->num_children;
    const Py_ssize_t vt = j->vt, num_dense = j->num_dense;
    const int es = j->es;
    const uint64_t neg_bits = j->neg_bits, floor_bits = j->floor_bits;
    const int64_t *rows = j->rows, *nodes = j->nodes, *filt = j->filt;
    const int32_t *table = j->table, *child_token = j->child_token, *child_ptr = j->child_ptr;
    const uint8_t *blocked = j->blocked, *const *flags = j->flags;
    Py_ssize_t vm = vt < width ? vt : width;  /* the columns of the vocabulary these logits have */
    const int32_t *done_row = table_row(table, -1, num_nodes, num_codes);  /* DONE keeps the end token */
    Py_ssize_t masked = 0, cap = ws->cap;
    int64_t *keep_col = ws->keep_col;
    int oom = 0;
    char pat[64];
    for (int b = 0; b < 64; b += es) store_bits(pat + b, es, (uint64_t)neg_bits);
    /* The bitmaps: the trie's (dense rows, then wide nodes; vwords words each) and scratch for the current state's. */
    const Py_ssize_t words = ws->words, vwords = (vt + 63) / 64;
    /* the bitmaps built with the trie, when they are all there */
    const uint64_t *trie_bits = j->bits && j->num_bits >= num_dense + (j->wide_nodes ? j->num_wide : 0) ? j->bits : NULL;
    const uint64_t *dense_bits = trie_bits, *row_bits = NULL;
    const int64_t *wide_nodes = trie_bits ? j->wide_nodes : NULL;
    const Py_ssize_t num_wide = wide_nodes ? j->num_wide : 0;
    uint64_t *scratch = ws->bits;
    Py_ssize_t row_cols = 0;  /* the columns row_bits covers (-inf beyond) */
#ifdef TD_BITS
    const int use_bits = bits_supported() && n > 0;
#else
    const int use_bits = 0;
    (void)row_cols;
#endif
    /* The state whose plan (below) is current: node plan_node under filter plan_filt (-1: none); none yet. */
    int have_plan = 0;
    int64_t plan_node = 0, plan_filt = -1;
    /* The plan: the kept columns keep_col[0..k) (ascending), the extras extra[0..nx), the dense row (slot, or -1)
     * and the children range start..start+count. */
    Py_ssize_t k = 0, nx = 0;
    int64_t extra[T_EXTRA1 - T_ANCHOR + 1], start = 0, count = 0;
    int dense = 0, wide = 0, bitmap = 0;
    const uint8_t *brow = NULL;

    /* Prefetch every row's table row, and in the loop the next row's child tokens: after a logits fill a big
     * trie is out of cache, and these loads would otherwise stall one after the other. */
    for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(table_row(table, nodes[i], num_nodes, num_codes));
    for (Py_ssize_t i = 0; i < n && !oom; i++) {
        if (i + 1 < n && nodes[i + 1] != nodes[i]) {
            const int32_t *nt = table_row(table, nodes[i + 1], num_nodes, num_codes);
            if (nt[T_START] >= 0 && nt[T_START] < num_children) {
                int64_t span = nt[T_COUNT] < 256 ? nt[T_COUNT] : 256;
                for (int64_t c = 0; c < span; c += 16) __builtin_prefetch(child_token + nt[T_START] + c);
            }
        }
        int64_t r = rows ? rows[i] : (int64_t)(j->row_base + i);  /* checked above */
        const int32_t *t = table_row(table, nodes[i], num_nodes, num_codes);
        char *drow = out + (Py_ssize_t)r * out_stride * es;
        const char *srow = src + (Py_ssize_t)r * src_stride * es;
        if (t[T_ANCHOR] < 0) {  /* unconstrained */
            if (drow != srow) memcpy(drow, srow, (size_t)width * es);
            continue;
        }
        masked++;
        int64_t slot = t[T_SLOT], m = nodes[i];
        const uint8_t *fl = (flags && m >= 0 && m < num_nodes) ? flags[filt[i]] : NULL;
        const int64_t f_i = fl ? filt[i] : -1;
        if (!have_plan || m != plan_node || f_i != plan_filt) {
            /* the entry ending here is not usable: no end token, no separator */
            int own_out = fl && (fl[m] & END_EXCLUDED);
            start = t[T_START], count = t[T_COUNT];
            dense = slot >= 0 && slot < num_dense;
            if (dense) {  /* the dense row holds the children; under a filter they are listed too (some are dropped) */
                if (fl) start = child_ptr[m], count = (int64_t)child_ptr[m + 1] - child_ptr[m];
                else count = 0;
            }
            if (start < 0 || count < 0 || start + count > num_children) count = 0;
            /* A wide node (its bitmap built with the trie): no list of its children, they are in the bitmap. */
            wide = 0;
            if (use_bits && !dense && !fl && count >= BITS_MIN_KEPT && num_wide > 0) {
                Py_ssize_t lo = 0, hi = num_wide;
                while (lo < hi) {
                    Py_ssize_t mid = lo + ((hi - lo) >> 1);
                    if (wide_nodes[mid] < m) lo = mid + 1;
                    else hi = mid;
                }
                if (lo < num_wide && wide_nodes[lo] == m) wide = 1, row_bits = trie_bits + (num_dense + lo) * vwords;
            }
            if (count + 4 > cap) {
                cap = count + 4;
                int64_t *c2 = (int64_t *)realloc(keep_col, cap * sizeof(int64_t));
                if (!c2) { oom = 1; break; }
                ws->keep_col = keep_col = c2, ws->cap = cap;
            }
            /* The kept children in ascending order (the children's tokens are sorted), and the kept extras. */
            k = 0, nx = 0;
            int64_t last = -1;
            for (int64_t c = 0; c < count && !wide; c++) {
                int64_t col = child_token[start + c];
                if (fl && (fl[start + c] & CHILD_EXCLUDED)) continue;  /* no usable entry below this child */
                if (col > last && col < vm) keep_col[k++] = last = col;
            }
            for (int e = T_ANCHOR; e <= T_EXTRA1; e++) {
                /* With a filter the anchor counts only as what it is: the first child (decided above), or, at a node
                 * without children, the end token (kept like the other extras only while the row's entry is
                 * usable). */
                if (fl && (e == T_ANCHOR ? (count > 0 || own_out) : own_out)) continue;
                if (t[e] >= 0 && t[e] < width) extra[nx++] = t[e];
            }
            /* Sparse rows, and dense rows under a filter, list every kept column: the extras join the children. */
            if ((!dense && !wide) || fl)
                for (Py_ssize_t e = 0; e < nx; e++) insert_sorted(keep_col, &k, extra[e]);
            brow = dense ? blocked + slot * vt : NULL;
            bitmap = use_bits && (dense ? dense_bits != NULL : (wide || k >= BITS_MIN_KEPT));
            if (wide) {
                row_cols = vm;
            } else if (bitmap && dense) {
                row_bits = dense_bits + slot * vwords, row_cols = vm;
                if (fl) {  /* the dense row's columns, less the excluded children, with the extras */
                    Py_ssize_t nw = vwords < words ? vwords : words;
                    memcpy(scratch, row_bits, (size_t)nw * sizeof(uint64_t));
                    memset(scratch + nw, 0, (size_t)(words - nw) * sizeof(uint64_t));
                    for (int64_t c = 0; c < count; c++) {
                        int64_t col = child_token[start + c];
                        if ((fl[start + c] & CHILD_EXCLUDED) && col >= 0 && col < vm)
                            scratch[col >> 6] &= ~((uint64_t)1 << (col & 63));
                    }
                    for (Py_ssize_t e = 0; e < nx; e++) scratch[extra[e] >> 6] |= (uint64_t)1 << (extra[e] & 63);
                    row_bits = scratch, row_cols = width;
                }
            } else if (bitmap) {
                /* keep_col ascends: each word is gathered in a register and stored once */
                memset(scratch, 0, (size_t)words * sizeof(uint64_t));
                uint64_t word = 0;
                int64_t at = k ? keep_col[0] >> 6 : 0;
                for (Py_ssize_t c = 0; c < k; c++) {
                    if (keep_col[c] >> 6 != at) scratch[at] = word, word = 0, at = keep_col[c] >> 6;
                    word |= (uint64_t)1 << (keep_col[c] & 63);
                }
                if (k) scratch[at] = word;
                row_bits = scratch, row_cols = width;
            }
            have_plan = 1, plan_node = m, plan_filt = f_i;
        }
        if (!dense && !wide) {
            /* A sparse row: -inf over the gaps between the kept columns (in place, the kept values are never
             * touched, so the row is only written, like the floor's fill; out of place they are copied across), or
             * one pass through its bitmap. */
#ifdef TD_BITS
            if (bitmap) bits_row(drow, srow, row_bits, row_cols, width, es, neg_bits, pat);
            else
#endif
            sparse_row(drow, srow, keep_col, k, width, es, neg_bits, pat);
            floor_rule(drow, keep_col, k, NULL, 0, NULL, vm, done_row, width, es, neg_bits, floor_bits);
            continue;
        }
        /* A dense row: a copy through its blocked columns, then -inf over the children the filter excludes; the
         * extras (which the dense row or the filter may block) are saved first and put back. With a bitmap, the
         * filter and the extras are in it already, but for the extras of a dense row without a filter, and of a
         * wide node (its bitmap holds its children). */
        uint64_t extra_val[T_EXTRA1 - T_ANCHOR + 1];
        if (!fl || !bitmap)
            for (Py_ssize_t e = 0; e < nx; e++) extra_val[e] = load_bits(srow + extra[e] * es, es);
#ifdef TD_BITS
        if (bitmap) bits_row(drow, srow, row_bits, row_cols, width, es, neg_bits, pat);
        else
#endif
        {
            dense_row(drow, srow, brow, vm, width, es, neg_bits, pat);
            if (fl)
                for (int64_t c = 0; c < count; c++) {
                    int64_t col = child_token[start + c];
                    if ((fl[start + c] & CHILD_EXCLUDED) && col >= 0 && col < vm) store_bits(drow + col * es, es, neg_bits);
                }
        }
        if (!fl || !bitmap)
            for (Py_ssize_t e = 0; e < nx; e++) store_bits(drow + extra[e] * es, es, extra_val[e]);
        if (fl)  /* the kept columns are listed: the kept children and the extras */
            floor_rule(drow, keep_col, k, NULL, 0, NULL, vm, done_row, width, es, neg_bits, floor_bits);
        else
            floor_rule(drow, extra, nx, wide ? child_token + start : NULL, wide ? count : 0, brow, vm, done_row, width, es,
                       neg_bits, floor_bits);
    }
    return oom ? -1 : masked;
}

/* One job with its own scratch memory. */
static Py_ssize_t mask_job_run(const MaskJob *j) {
    Workspace ws;
    Py_ssize_t masked = workspace_init(&ws, j->width) ? mask_job_work(j, &ws) : -1;
    workspace_free(&ws);
    return masked;
}

/* Running the jobs of one call (the rows of several tries), with one scratch memory for them all: the rows masked,
 * or -1 when out of memory. */
static Py_ssize_t run_jobs(const MaskJob *jobs, Py_ssize_t g) {
    Py_ssize_t masked = 0;
    Workspace ws;
    if (g == 0) return 0;
    if (!workspace_init(&ws, jobs[0].width)) {  /* the jobs of one call share the logits */
        workspace_free(&ws);
        return -1;
    }
    for (Py_ssize_t q = 0; q < g; q++) {
        Py_ssize_t r = mask_job_work(&jobs[q], &ws);
        if (r < 0) {
            masked = -1;
            break;
        }
        masked += r;
    }
    workspace_free(&ws);
    return masked;
}

/* mask(tries, job[, tree]) -> number of rows masked; tries: the packed TRIE_FIELDS of k tries, one after another;
 * job: MASK_FIELDS (the logits, then n, rows, nodes, flags, filter, num_filters); tree: the address of the n rows'
 * trie indices (int64, each in [0, k), checked), needed when k > 1.
 *
 * For i < n: logits row rows[i] (or i when rows is 0) is masked by the state nodes[i]. src and out point at
 * (batch, width) arrays of elsize-byte floats with those row strides (they may be the same array); width columns
 * are used; the trie's vocabulary vt is the row length of the (num_dense, vt) uint8 array blocked that holds the
 * dense rows. Logits narrower than the vocabulary (a tokenizer wider than the model's output) are masked over their
 * own width: the caller checks that every token the trie and its rules can keep lies inside it. A row whose anchor
 * is -1 is unconstrained: copied when out != src, else left alone. Every masked row then gets the floor rule
 * (floor_rule: neg_bits and floor_bits are the bit patterns of -inf and of the floor in the logits' dtype).
 *
 * Filters (optional: flags 0 for none): flags is the address of num_filters pointers, flags[f] filter f's
 * (num_nodes,) uint8 flags (rows kept apart: a batch's filters are the trie's cached rows, never copied together),
 * filter[i] the filter of state row i; the bits are the filter rule as data, computed in one place
 * (trie_decode/filters.py, filter_bits): bit 0 of flags[f][m], no usable entry below node m (a child m is
 * dropped); bit 1, the entry ending at m is not usable (the row's end token and separator are dropped, unless they
 * are usable children). Filters need one trie (k = 1): their flags are one trie's nodes.
 *
 * Rows of several tries: the rows are masked in their order, each run of consecutive rows of one trie as that trie
 * alone would mask it: one call, whatever the number of tries, no sorting, and the logits rows written in the order
 * a single trie's would be. */
static PyObject *py_mask(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t f[MF_COUNT];
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "mask(tries, job[, tree]) takes 2 or 3 arguments, got %zd", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) == 0
        || PyBytes_GET_SIZE(args[0]) % (Py_ssize_t)(TF_COUNT * sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_TypeError, "tries must be bytes of k * %d packed int64 fields", (int)TF_COUNT);
        return NULL;
    }
    if (!read_fields(args[1], f, MF_COUNT, "job")) return NULL;
    const int64_t *tree = nargs == 3 ? (const int64_t *)PyLong_AsVoidPtr(args[2]) : NULL;
    if (PyErr_Occurred()) return NULL;
    const Py_ssize_t k = PyBytes_GET_SIZE(args[0]) / (Py_ssize_t)(TF_COUNT * sizeof(int64_t));
    const Py_ssize_t n = (Py_ssize_t)f[MF_N];
    const int64_t *rows = (const int64_t *)(intptr_t)f[MF_ROWS], *nodes = (const int64_t *)(intptr_t)f[MF_NODES];
    const int64_t *filt = (const int64_t *)(intptr_t)f[MF_FILTER];
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "the job names %zd rows", n);
        return NULL;
    }
    if (k > 1 && !tree) {
        PyErr_SetString(PyExc_ValueError, "rows of several tries need each row's trie (tree)");
        return NULL;
    }
    if (f[MF_FLAGS] && k != 1) {
        PyErr_SetString(PyExc_ValueError, "filter flags are one trie's: mask them with that trie alone");
        return NULL;
    }
    Py_ssize_t g = tree ? 0 : 1;  /* the jobs: one per run of consecutive rows of one trie */
    for (Py_ssize_t i = 0; tree && i < n; i++) {
        if (tree[i] < 0 || tree[i] >= k) {
            PyErr_Format(PyExc_IndexError, "row %zd names trie %lld of %zd", i, (long long)tree[i], k);
            return NULL;
        }
        g += i == 0 || tree[i] != tree[i - 1];
    }
    MaskJob *jobs = (MaskJob *)malloc((size_t)(g > 0 ? g : 1) * sizeof(MaskJob));
    if (!jobs) return PyErr_NoMemory();
    for (Py_ssize_t i = 0, q = 0; q < g; q++) {  /* job q: the run of rows i..e-1 of trie tree[i] (trie 0 without tree) */
        Py_ssize_t e = i + 1, t = tree ? tree[i] : 0;
        while (e < n && (!tree || tree[e] == t)) e++;
        if (e > n) e = n;
        int64_t tf[TF_COUNT];
        memcpy(tf, PyBytes_AS_STRING(args[0]) + t * TF_COUNT * sizeof(int64_t), sizeof(tf));
        mask_job_init(&jobs[q], tf, f);
        jobs[q].n = e - i, jobs[q].nodes = nodes ? nodes + i : NULL;
        if (rows) jobs[q].rows = rows + i;
        else jobs[q].row_base = i;
        jobs[q].flags = (const uint8_t *const *)(intptr_t)f[MF_FLAGS], jobs[q].filt = filt ? filt + i : NULL;
        jobs[q].num_filters = (Py_ssize_t)f[MF_NUM_FILTERS];
        if (!mask_job_check(&jobs[q])) {
            free(jobs);
            return NULL;
        }
        i = e;
    }
    if (rows && n > 1) {  /* every row is in the batch (mask_job_check): no logits row may be two state rows' */
        const Py_ssize_t batch = (Py_ssize_t)f[LF_BATCH];
        uint8_t *seen = (uint8_t *)calloc((size_t)batch, 1);
        if (!seen) {
            free(jobs);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (seen[rows[i]]) {
                Py_ssize_t first = 0;
                while (rows[first] != rows[i]) first++;
                PyErr_Format(PyExc_ValueError, "rows gives logits row %lld to state rows [%zd, %zd]: each state row "
                             "masks a row of its own", (long long)rows[i], first, i);
                free(seen);
                free(jobs);
                return NULL;
            }
            seen[rows[i]] = 1;
        }
        free(seen);
    }
    Py_ssize_t masked;
    Py_BEGIN_ALLOW_THREADS
    masked = run_jobs(jobs, g);
    Py_END_ALLOW_THREADS
    free(jobs);
    if (masked < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(masked);
}

/* out[i] = the child of node nodes[i] by token tokens[i * tstride] (see py_child); bounds: 2n int64 of scratch. No
 * GIL needed. */
static void child_rows(int64_t *out, const int64_t *nodes, const int64_t *tokens, Py_ssize_t tstride, Py_ssize_t n,
                       const int32_t *child_ptr, const int32_t *child_token, Py_ssize_t num_nodes,
                       const int32_t *table, Py_ssize_t num_codes, const uint8_t *const *flags, const int64_t *filt,
                       int64_t *bounds) {

    Py_ssize_t i;
    for (i = 0; i < n; i++)
        if (nodes[i] >= 0 && nodes[i] < num_nodes) __builtin_prefetch(child_ptr + nodes[i]);
    /* bounds[2i], bounds[2i+1]: the search range of row i; an empty range once the row is settled */
    for (i = 0; i < n; i++) {
        int64_t m = nodes[i], lo = 0, hi = 0;
        if (m >= 0 && m < num_nodes && tokens[i * tstride] >= 0) {
            lo = child_ptr[m], hi = child_ptr[m + 1];
            if (lo < 0) lo = 0;
            if (hi > num_nodes) hi = num_nodes;
            if (lo < hi) __builtin_prefetch(child_token + lo + ((hi - lo) >> 1));
        }
        bounds[2 * i] = lo, bounds[2 * i + 1] = hi;
        out[i] = lo;  /* the first child position >= the token, once the search ends */
    }
    for (int active = 1; active;) {
        active = 0;
        for (i = 0; i < n; i++) {
            int64_t lo = bounds[2 * i], hi = bounds[2 * i + 1];
            if (lo >= hi) continue;
            int64_t mid = lo + ((hi - lo) >> 1);
            if (child_token[mid] < tokens[i * tstride]) lo = mid + 1;
            else hi = mid;
            bounds[2 * i] = lo, bounds[2 * i + 1] = hi;
            if (lo < hi) {
                __builtin_prefetch(child_token + lo + ((hi - lo) >> 1));
                active = 1;
            }
            out[i] = lo;
        }
    }
    for (i = 0; i < n; i++) {
        int64_t m = nodes[i], pos = out[i];
        int ok = m >= 0 && m < num_nodes && tokens[i * tstride] >= 0 && pos < num_nodes && pos < child_ptr[m + 1] &&
                 child_token[pos] == tokens[i * tstride];
        const uint8_t *fl = (flags && m >= 0 && m < num_nodes) ? flags[filt[i]] : NULL;
        if (ok && fl && (fl[pos] & CHILD_EXCLUDED)) ok = 0;  /* an excluded child is no child */
        if (ok) out[i] = pos;
        else if (!table) out[i] = -1;
        else if (fl && (fl[m] & END_EXCLUDED)) out[i] = -1;  /* leaving an excluded entry's end: DONE */
        else {
            const int32_t *t = table_row(table, m, num_nodes, num_codes);
            out[i] = (t[T_ON_TOKEN] >= 0 && tokens[i * tstride] == t[T_ON_TOKEN]) ? t[T_ON_MATCH] : t[T_OTHERWISE];
        }
    }
}

/* child(trie, job) -> None; job: CHILD_FIELDS (out, nodes, tokens, n, moves, flags, filter, num_filters).
 *
 * out[i] = the child of node nodes[i] by token tokens[i]; where there is none (or nodes[i] is not a node): -1 when
 * moves is 0, else the step table's move for that state (trie_decode/spans.py: ON_MATCH on the token ON_TOKEN,
 * OTHERWISE on any other), so that one call is the whole state update.
 * Children of node m are m's CSR range child_ptr[m]..child_ptr[m+1]-1, sorted by token. The rows' binary searches
 * run in lockstep, one level for every row per pass, with the next probe prefetched: a big trie's arrays are out of
 * cache after every logits fill, and this way the rows' cache misses overlap instead of adding up.
 *
 * Filters (optional, with moves): the filter bits of mask() (bit 0: no usable entry below the node, bit 1: the
 * entry ending at the node is not usable). A child with bit 0 is no child for the row: its token moves as a token
 * off the trie does; a row that leaves a node with bit 1 set (not down a usable child) ends (DONE), as at a node
 * that ends no entry. */
static PyObject *py_child(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t tf[TF_COUNT], f[CF_COUNT];
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "child(trie, job) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    if (!read_fields(args[0], tf, TF_COUNT, "trie") || !read_fields(args[1], f, CF_COUNT, "job")) return NULL;
    const int32_t *table = f[CF_MOVES] ? (const int32_t *)(intptr_t)tf[TF_TABLE] : NULL;
    const uint8_t *const *flags = (const uint8_t *const *)(intptr_t)f[CF_FLAGS];
    const int64_t *filt = (const int64_t *)(intptr_t)f[CF_FILTER];
    const Py_ssize_t n = (Py_ssize_t)f[CF_N], num_nodes = (Py_ssize_t)tf[TF_NUM_NODES];
    const Py_ssize_t num_codes = (Py_ssize_t)tf[TF_NUM_CODES];
    if (!tf[TF_CHILD_PTR] || !tf[TF_CHILD_TOKEN] || num_nodes < 1 || !f[CF_OUT] || !f[CF_NODES] || !f[CF_TOKENS]) {
        PyErr_SetString(PyExc_ValueError, "child() needs the trie arrays and the out, nodes and tokens arrays");
        return NULL;
    }
    if (f[CF_MOVES] && (!table || num_codes < 1)) {
        PyErr_SetString(PyExc_ValueError, "the span rules' moves need a step table with at least one code row");
        return NULL;
    }
    if (flags && (!table || !filt || f[CF_NUM_FILTERS] < 1)) {
        PyErr_SetString(PyExc_ValueError, "filter flags need the step table's moves and each row's filter");
        return NULL;
    }
    if (flags && !filters_in_range(flags, (Py_ssize_t)f[CF_NUM_FILTERS], filt, n)) return NULL;
    int64_t *bounds = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(int64_t));
    if (!bounds) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    child_rows((int64_t *)(intptr_t)f[CF_OUT], (const int64_t *)(intptr_t)f[CF_NODES],
               (const int64_t *)(intptr_t)f[CF_TOKENS], 1, n, (const int32_t *)(intptr_t)tf[TF_CHILD_PTR],
               (const int32_t *)(intptr_t)tf[TF_CHILD_TOKEN], num_nodes, table, num_codes, flags, filt, bounds);
    Py_END_ALLOW_THREADS
    free(bounds);
    Py_RETURN_NONE;
}

/* step(trie, job[, out, src, tokens, token_stride, parents, parent_stride]) -> number of rows masked; job:
 * STEP_FIELDS (the logits, then nodes, tokens, token_stride, parents, parent_stride, parent_size, moves, flags,
 * filter, num_filters). The six
 * optional int arguments replace those fields of the job (STEP_CALL_FIELDS): a caller that steps the same rows
 * again and again packs the rest once and passes only what changes at every call.
 *
 * A whole decoding step of batch rows that keep their places (logits row i is state row i), in one call: with
 * tokens (not 0), each row first moves from the node of its parent row (parents[i * parent_stride],
 * parent_size-byte ints; row i itself when parents is 0) by the token tokens[i * token_stride], as child() does
 * (moves: 1 to take the span rules' moves off the trie from the step table, 0 for plain rules); nodes (batch
 * int64) is updated in place. Then the rows are masked as mask() does. Static filters (flags, filter and
 * num_filters as in mask(); they need moves 1): each row takes its parent row's filter (filter, batch int64, is
 * updated in place), moves over the trie that filter leaves it, as child() does, and is masked with it. The token
 * and parent strides read them straight from the generation's own arrays (the last column of input_ids, a column of
 * beam search's parent indices). A parent outside [0, batch) raises IndexError before anything is written. */
static PyObject *py_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t tf[TF_COUNT], f[SF_COUNT];
    MaskJob j;
    if (nargs != 2 && nargs != 2 + STEP_CALL_COUNT) {
        PyErr_Format(PyExc_TypeError, "step(trie, job[, out, src, tokens, token_stride, parents, parent_stride]) "
                     "takes 2 or %d arguments, got %zd", 2 + STEP_CALL_COUNT, nargs);
        return NULL;
    }
    if (!read_fields(args[0], tf, TF_COUNT, "trie") || !read_fields(args[1], f, SF_COUNT, "job")) return NULL;
    for (Py_ssize_t a = 2; a < nargs; a++) {  /* the per-call fields, over the job's */
        const int64_t v = PyLong_AsLongLong(args[a]);
        if (v == -1 && PyErr_Occurred()) return NULL;
        f[STEP_CALL_FIELDS[a - 2]] = v;
    }
    mask_job_init(&j, tf, f);
    j.n = j.batch, j.nodes = (const int64_t *)(intptr_t)f[SF_NODES];
    j.flags = (const uint8_t *const *)(intptr_t)f[SF_FLAGS], j.filt = (const int64_t *)(intptr_t)f[SF_FILTER];
    j.num_filters = (Py_ssize_t)f[SF_NUM_FILTERS];
    if (j.flags && !f[SF_MOVES]) {
        PyErr_SetString(PyExc_ValueError, "filter flags need the step table's moves");
        return NULL;
    }
    if (!mask_job_check(&j)) return NULL;
    const Py_ssize_t n = j.n;
    int64_t *nodes = (int64_t *)(intptr_t)f[SF_NODES];
    const char *parents = (const char *)(intptr_t)f[SF_PARENTS];
    const int64_t *tokens = (const int64_t *)(intptr_t)f[SF_TOKENS];
    const Py_ssize_t token_stride = (Py_ssize_t)f[SF_TOKEN_STRIDE], parent_stride = (Py_ssize_t)f[SF_PARENT_STRIDE];
    const int parent_size = (int)f[SF_PARENT_SIZE];
    if (parents && parent_size != 4 && parent_size != 8) {
        PyErr_Format(PyExc_ValueError, "parent indices must be 4- or 8-byte integers, got %d bytes", parent_size);
        return NULL;
    }
    if (n == 0) return PyLong_FromSsize_t(0);  /* no rows (mask_job_check let their arrays be NULL) */
    /* scratch: the parents' nodes (n), the new nodes (n), the searches' bounds (2n), the parents' filters (n) */
    int64_t *scratch = NULL;
    if (tokens && !(scratch = (int64_t *)malloc((size_t)n * 5 * sizeof(int64_t)))) return PyErr_NoMemory();  /* n > 0 */
    int64_t *from = scratch, *filt_from = scratch + 4 * n;
    if (tokens) {
        /* each row's parent node, every parent index checked before anything is written */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t parent = i;
            if (parents) {
                const char *p = parents + i * parent_stride * parent_size;
                parent = parent_size == 4 ? *(const int32_t *)p : *(const int64_t *)p;
                if (parent < 0 || parent >= n) {
                    PyErr_Format(PyExc_IndexError, "row %zd names parent row %lld of %zd rows", i, (long long)parent, n);
                    free(scratch);
                    return NULL;
                }
            }
            from[i] = nodes[parent];
            if (j.flags) filt_from[i] = j.filt[parent];  /* a row keeps its filter: the one its parent row had */
        }
    }
    Py_ssize_t masked;
    Py_BEGIN_ALLOW_THREADS
    if (tokens) {
        int64_t *next = scratch + n;
        if (j.flags) memcpy((int64_t *)(intptr_t)f[SF_FILTER], filt_from, (size_t)n * sizeof(int64_t));
        child_rows(next, from, tokens, token_stride, n, j.child_ptr, j.child_token, j.num_nodes,
                   f[SF_MOVES] ? j.table : NULL, j.num_codes, j.flags, j.filt, scratch + 2 * n);
        memcpy(nodes, next, (size_t)n * sizeof(int64_t));
    }
    masked = mask_job_run(&j);
    Py_END_ALLOW_THREADS
    free(scratch);
    if (masked < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(masked);
}

static PyMethodDef methods[] = {
    {"mask", (PyCFunction)(void (*)(void))py_mask, METH_FASTCALL,
     "mask(tries, job[, tree]): mask logits rows by their trie states, each row naming its trie (see _kernel.c)."},
    {"child", (PyCFunction)(void (*)(void))py_child, METH_FASTCALL,
     "child(trie, job): the child of each node by each token, or the rules' move (see _kernel.c)."},
    {"step", (PyCFunction)(void (*)(void))py_step, METH_FASTCALL,
     "step(trie, job): advance rows that keep their places and mask their logits (see _kernel.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kernel", .m_doc = "trie_decode's fused CPU step.", .m_size = -1, .m_methods = methods,
};

/* The module exports the number of packed fields of each kind, checked against the field names on the Python side,
 * whether this CPU takes the bitmap pass (BITMAP_PASS: then the Python side builds the trie's bitmaps) and from how
 * many kept columns a row takes it (BITS_MIN_KEPT: the Python side builds the bitmaps of nodes with that many
 * children). */
PyMODINIT_FUNC PyInit__kernel(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "TRIE_FIELDS", TF_COUNT) < 0
        || PyModule_AddIntConstant(m, "LOGITS_FIELDS", LF_COUNT) < 0
        || PyModule_AddIntConstant(m, "MASK_FIELDS", MF_COUNT) < 0
        || PyModule_AddIntConstant(m, "STEP_FIELDS", SF_COUNT) < 0
        || PyModule_AddIntConstant(m, "CHILD_FIELDS", CF_COUNT) < 0
        || PyModule_AddIntConstant(m, "CHILD_EXCLUDED", CHILD_EXCLUDED) < 0
        || PyModule_AddIntConstant(m, "END_EXCLUDED", END_EXCLUDED) < 0
#ifdef TD_BITS
        || PyModule_AddIntConstant(m, "BITMAP_PASS", bits_supported()) < 0
#else
        || PyModule_AddIntConstant(m, "BITMAP_PASS", 0) < 0
#endif
        || PyModule_AddIntConstant(m, "BITS_MIN_KEPT", BITS_MIN_KEPT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
