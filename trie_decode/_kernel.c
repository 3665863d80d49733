/* The fused CPU step of trie_decode: masking logits rows and advancing trie nodes in one pass over each row.
 *
 * Why this exists: on a CPU the vectorized numpy/torch path costs a few dozen array operations per step (a ragged
 * gather of the kept (row, token) pairs, a take, a fill, a put); at batch 64 that fixed cost is several times the
 * physical floor, the fill(-inf) of the logits. This kernel does, per row, what the reference loop of
 * trie_decode/kernels/__init__.py says, in one pass: -inf over the gaps between the row's kept columns (or a copy through
 * the dense row's blocked columns). In place it only writes, like the floor itself.
 *
 * It is optional: trie_decode/kernels/native.py loads it when it was compiled and falls back to the numpy/torch path
 * otherwise (and always on CUDA and MPS). Both paths read the same step table and are tested against each other.
 *
 * Rows another processor emptied: when every value a row keeps is already -inf (e.g. min_new_tokens banned the end
 * token, bad_words banned the only child), the kept columns get the finite floor value instead, so the row still
 * picks a token of the trie (see trie_decode/kernels/__init__.py).
 *
 * Memory safety: the Python wrapper passes raw data pointers of arrays whose dtype, contiguity and shape it has
 * checked; this file additionally bounds-checks every node id and token it reads from per-step state, so a
 * corrupt state can give a wrong mask but never an out-of-bounds access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <wchar.h>

/* Step table columns (trie_decode/spans.py). */
enum { T_START, T_COUNT, T_SLOT, T_ANCHOR, T_EXTRA0, T_EXTRA1, T_ON_TOKEN, T_ON_MATCH, T_OTHERWISE, T_COLS };

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

/* True when no kept column of a sparse row holds anything but the -inf pattern. */
static int all_neg(const char *drow, const int64_t *cols, Py_ssize_t k, int es, uint64_t bits) {
    for (Py_ssize_t j = 0; j < k; j++)
        if (load_bits(drow + cols[j] * es, es) != bits) return 0;
    return 1;
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

/* True when every row's filter index is in [0, num_filters); else an IndexError is set. */
static int filters_in_range(const int64_t *filt, Py_ssize_t n, Py_ssize_t num_filters) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (filt[i] < 0 || filt[i] >= num_filters) {
            PyErr_Format(PyExc_IndexError, "row %zd names filter %lld of %zd", i, (long long)filt[i], num_filters);
            return 0;
        }
    return 1;
}

/* One masking call: the logits geometry, the rows' states, the step table and the trie (see py_mask). */
typedef struct {
    char *out;
    const char *src;
    Py_ssize_t batch, out_stride, src_stride, width;
    int es;
    uint64_t neg_bits, floor_bits;
    Py_ssize_t n;
    const int64_t *rows, *nodes;
    const int32_t *table;
    Py_ssize_t num_nodes, num_codes;
    const int32_t *child_token;
    Py_ssize_t num_children;
    const uint8_t *blocked;
    Py_ssize_t vt, num_dense;
    const int32_t *child_ptr;
    const uint8_t *flags;
    const int64_t *filt;
    Py_ssize_t num_filters;
} MaskJob;

/* The job's checks, with the GIL held: 0 with an exception set when it is inconsistent. */
static int mask_job_check(const MaskJob *j) {
    if (j->flags && (!j->filt || !j->child_ptr || j->num_filters < 1)) {
        PyErr_SetString(PyExc_ValueError, "filter flags need each row's filter and the child pointers");
        return 0;
    }
    if (j->flags && !filters_in_range(j->filt, j->n, j->num_filters)) return 0;
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
    } else if (j->n > j->batch) {
        PyErr_Format(PyExc_IndexError, "%zd states for a batch of %zd logits rows", j->n, j->batch);
        return 0;
    }
    return 1;
}

/* The masking itself (no GIL needed; run after mask_job_check): the number of rows masked, or -1 when out of
 * memory. */
static Py_ssize_t mask_job_run(const MaskJob *j) {
    char *out = j->out;
    const char *src = j->src;
    const Py_ssize_t out_stride = j->out_stride, src_stride = j->src_stride, width = j->width, n = j->n;
    const Py_ssize_t num_nodes = j->num_nodes, num_codes = j->num_codes, num_children = j->num_children;
    const Py_ssize_t vt = j->vt, num_dense = j->num_dense;
    const int es = j->es;
    const uint64_t neg_bits = j->neg_bits, floor_bits = j->floor_bits;
    const int64_t *rows = j->rows, *nodes = j->nodes, *filt = j->filt;
    const int32_t *table = j->table, *child_token = j->child_token, *child_ptr = j->child_ptr;
    const uint8_t *blocked = j->blocked, *flags = j->flags;
    Py_ssize_t vm = vt < width ? vt : width;  /* the columns of the vocabulary these logits have */
    const int64_t end_token = table_row(table, -1, num_nodes, num_codes)[T_ANCHOR];  /* DONE keeps the end token */
    Py_ssize_t masked = 0, cap = 64;
    int64_t *keep_col = NULL;
    int oom = 0;
    char pat[64];
    for (int b = 0; b < 64; b += es) store_bits(pat + b, es, (uint64_t)neg_bits);

    keep_col = (int64_t *)malloc(cap * sizeof(int64_t));
    if (!keep_col) oom = 1;
    /* Prefetch every row's table row, and in the loop the next row's child tokens: after a logits fill a big
     * trie is out of cache, and these loads would otherwise stall one after the other. */
    for (Py_ssize_t i = 0; i < n; i++) __builtin_prefetch(table_row(table, nodes[i], num_nodes, num_codes));
    for (Py_ssize_t i = 0; i < n && !oom; i++) {
        if (i + 1 < n) {
            const int32_t *nt = table_row(table, nodes[i + 1], num_nodes, num_codes);
            if (nt[T_START] >= 0 && nt[T_START] < num_children) {
                int64_t span = nt[T_COUNT] < 256 ? nt[T_COUNT] : 256;
                for (int64_t c = 0; c < span; c += 16) __builtin_prefetch(child_token + nt[T_START] + c);
            }
        }
        int64_t r = rows ? rows[i] : (int64_t)i;  /* checked above */
        const int32_t *t = table_row(table, nodes[i], num_nodes, num_codes);
        char *drow = out + (Py_ssize_t)r * out_stride * es;
        const char *srow = src + (Py_ssize_t)r * src_stride * es;
        if (t[T_ANCHOR] < 0) {  /* unconstrained */
            if (drow != srow) memcpy(drow, srow, (size_t)width * es);
            continue;
        }
        masked++;
        int64_t slot = t[T_SLOT], m = nodes[i];
        const uint8_t *fl = (flags && m >= 0 && m < num_nodes) ? flags + filt[i] * num_nodes : NULL;
        int own_out = fl && (fl[m] & 2);  /* the entry ending here is not usable: no end token, no separator */
        if (slot >= 0 && slot < num_dense) {
            /* A dense row: its children are the unblocked columns; the extras (end token, separator) are saved
             * first and put back, since the dense row may block them. With a filter, excluded children are
             * dropped again after the copy, and the extras come back only where the row keeps them. */
            uint64_t extra_val[T_EXTRA1 - T_ANCHOR + 1] = {0};
            for (int e = T_ANCHOR; e <= T_EXTRA1; e++)
                if (t[e] >= 0 && t[e] < width) extra_val[e - T_ANCHOR] = load_bits(srow + (Py_ssize_t)t[e] * es, es);
            const uint8_t *brow = blocked + slot * vt;
            dense_row(drow, srow, brow, vm, width, es, neg_bits, pat);
            int32_t lo = 0, hi = 0;
            if (fl) {
                lo = child_ptr[m] < 0 ? 0 : child_ptr[m];
                hi = child_ptr[m + 1] > num_nodes ? (int32_t)num_nodes : child_ptr[m + 1];
                for (int32_t p = lo; p < hi; p++)
                    if ((fl[p] & 1) && child_token[p] >= 0 && child_token[p] < vm)
                        store_bits(drow + (Py_ssize_t)child_token[p] * es, es, neg_bits);
            }
            int alive = 0, kept = 0;
            for (int e = T_ANCHOR; e <= T_EXTRA1; e++)
                /* the anchor of a dense node is its first child, which the dense row (and filter) already decided */
                if (t[e] >= 0 && t[e] < width && !(fl && (e == T_ANCHOR || own_out))) {
                    store_bits(drow + (Py_ssize_t)t[e] * es, es, extra_val[e - T_ANCHOR]);
                    alive |= extra_val[e - T_ANCHOR] != neg_bits;
                    kept = 1;
                }
            if (!fl) {
                for (Py_ssize_t j = 0; j < vm && !alive; j++) alive = !brow[j] && load_bits(drow + j * es, es) != neg_bits;
                if (!alive) {  /* every kept value was already -inf: the floor instead */
                    for (Py_ssize_t j = 0; j < vm; j++)
                        if (!brow[j]) store_bits(drow + j * es, es, (uint64_t)floor_bits);
                    for (int e = T_ANCHOR; e <= T_EXTRA1; e++)
                        if (t[e] >= 0 && t[e] < width) store_bits(drow + (Py_ssize_t)t[e] * es, es, (uint64_t)floor_bits);
                }
                continue;
            }
            for (int32_t p = lo; p < hi; p++) {
                int32_t col = child_token[p];
                if (!(fl[p] & 1) && col >= 0 && col < vm) {
                    kept = 1;
                    alive |= load_bits(drow + (Py_ssize_t)col * es, es) != neg_bits;
                }
            }
            if (!kept) {  /* the filter leaves nothing: the end token at the floor */
                if (end_token >= 0 && end_token < width) store_bits(drow + (Py_ssize_t)end_token * es, es, (uint64_t)floor_bits);
            } else if (!alive) {  /* every kept value was already -inf: the floor instead */
                for (int32_t p = lo; p < hi; p++) {
                    int32_t col = child_token[p];
                    if (!(fl[p] & 1) && col >= 0 && col < vm) store_bits(drow + (Py_ssize_t)col * es, es, (uint64_t)floor_bits);
                }
                for (int e = T_EXTRA0; e <= T_EXTRA1; e++)
                    if (t[e] >= 0 && t[e] < width && !own_out) store_bits(drow + (Py_ssize_t)t[e] * es, es, (uint64_t)floor_bits);
            }
            continue;
        }
        /* A sparse row: the kept columns in ascending order (the children's tokens are sorted, the extras are
         * inserted), then -inf over the gaps between them. In place, the kept values are never touched, so the
         * row is only written, like the floor's fill; out of place they are copied across. */
        int64_t start = t[T_START], count = t[T_COUNT];
        if (start < 0 || count < 0 || start + count > num_children) count = 0;
        if (count + 4 > cap) {
            cap = count + 4;
            int64_t *c2 = (int64_t *)realloc(keep_col, cap * sizeof(int64_t));
            if (!c2) { oom = 1; break; }
            keep_col = c2;
        }
        Py_ssize_t k = 0;
        for (int64_t c = 0; c < count; c++) {
            int64_t col = child_token[start + c];
            if (fl && (fl[start + c] & 1)) continue;  /* the filter excludes every entry below this child */
            if (col >= 0 && col < vm && (k == 0 || col > keep_col[k - 1])) keep_col[k++] = col;
        }
        for (int e = T_ANCHOR; e <= T_EXTRA1; e++) {
            /* With a filter the anchor counts only as what it is: the first child (decided above), or, at a node
             * without children, the end token (kept like the other extras only while the row's entry is usable). */
            if (fl && (e == T_ANCHOR ? (count > 0 || own_out) : own_out)) continue;
            if (t[e] >= 0 && t[e] < width) insert_sorted(keep_col, &k, t[e]);
        }
        if (fl && k == 0) {  /* the filter leaves nothing: the end token at the floor */
            sparse_row(drow, srow, keep_col, 0, width, es, neg_bits, pat);
            if (end_token >= 0 && end_token < width) store_bits(drow + (Py_ssize_t)end_token * es, es, (uint64_t)floor_bits);
            continue;
        }
        sparse_row(drow, srow, keep_col, k, width, es, neg_bits, pat);
        if (all_neg(drow, keep_col, k, es, neg_bits))  /* every kept value was already -inf: the floor instead */
            for (Py_ssize_t j = 0; j < k; j++) store_bits(drow + keep_col[j] * es, es, (uint64_t)floor_bits);
    }
    free(keep_col);
    return oom ? -1 : masked;
}

/* mask(out, src, batch, out_stride, src_stride, width, elsize, neg_bits, floor_bits, n, rows, nodes, table, num_nodes,
 *      num_codes, child_token, num_children, blocked, vt, num_dense, child_ptr, flags, filt, num_filters)
 *      -> number of rows masked (child_ptr, flags, filt: 0 without filters; see below)
 *
 * For i < n: logits row rows[i] (or i when rows is 0) is masked by the state nodes[i]. src and out point at
 * (batch, width) arrays of elsize-byte floats with those row strides (they may be the same array); width columns are used; vt
 * is the trie's vocabulary and the row length of the (num_dense, vt) uint8 array blocked that holds the dense rows. Logits
 * narrower than the vocabulary (a tokenizer wider than the model's output) are masked over their own width: the
 * caller checks that every token the trie and its rules can keep lies inside it. A row whose anchor is -1
 * is unconstrained: copied when out != src, else left alone. A masked row whose kept values are all -inf gets
 * floor_bits (a finite value) in its kept columns.
 *
 * Filters (optional: flags 0 for none): flags is (num_filters, num_nodes) uint8, filt[i] the filter of state row i;
 * bit 0 of flags[f][m]: no usable entry below node m (a child m is dropped); bit 1: the entry ending at m is not
 * usable (the row's end token and separator are dropped, unless they are usable children). A row left with nothing
 * keeps the end token at the floor value. child_ptr (num_nodes + 1 int32) lists a dense node's children.
 * trie_decode/filters.py computes the flags from the same rule its torch pass applies. */
static PyObject *py_mask(PyObject *self, PyObject *args) {
    Py_ssize_t out_p, src_p, rows_p, nodes_p, table_p, child_token_p, blocked_p, child_ptr_p, flags_p, filt_p;
    unsigned long long neg_bits, floor_bits;
    MaskJob j;
    if (!PyArg_ParseTuple(args, "nnnnnniKKnnnnnnnnnnnnnnn", &out_p, &src_p, &j.batch, &j.out_stride, &j.src_stride,
                          &j.width, &j.es, &neg_bits, &floor_bits, &j.n, &rows_p, &nodes_p, &table_p, &j.num_nodes,
                          &j.num_codes, &child_token_p, &j.num_children, &blocked_p, &j.vt, &j.num_dense, &child_ptr_p,
                          &flags_p, &filt_p, &j.num_filters))
        return NULL;
    j.out = (char *)out_p, j.src = (const char *)src_p, j.neg_bits = neg_bits, j.floor_bits = floor_bits;
    j.rows = (const int64_t *)rows_p, j.nodes = (const int64_t *)nodes_p, j.table = (const int32_t *)table_p;
    j.child_token = (const int32_t *)child_token_p, j.blocked = (const uint8_t *)blocked_p;
    j.child_ptr = (const int32_t *)child_ptr_p, j.flags = (const uint8_t *)flags_p, j.filt = (const int64_t *)filt_p;
    if (!mask_job_check(&j)) return NULL;
    Py_ssize_t masked;
    Py_BEGIN_ALLOW_THREADS
    masked = mask_job_run(&j);
    Py_END_ALLOW_THREADS
    if (masked < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(masked);
}

/* out[i] = the child of node nodes[i] by token tokens[i * tstride] (see py_child); bounds: 2n int64 of scratch. No
 * GIL needed. */
static void child_rows(int64_t *out, const int64_t *nodes, const int64_t *tokens, Py_ssize_t tstride, Py_ssize_t n,
                       const int32_t *child_ptr, const int32_t *child_token, Py_ssize_t num_nodes,
                       const int32_t *table, Py_ssize_t num_codes, const uint8_t *flags, const int64_t *filt,
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
        const uint8_t *fl = (flags && m >= 0 && m < num_nodes) ? flags + filt[i] * num_nodes : NULL;
        if (ok && fl && (fl[pos] & 1)) ok = 0;  /* an excluded child is no child */
        if (ok) out[i] = pos;
        else if (!table) out[i] = -1;
        else if (fl && (fl[m] & 2)) out[i] = -1;  /* leaving an excluded entry's end: DONE */
        else {
            const int32_t *t = table_row(table, m, num_nodes, num_codes);
            out[i] = (t[T_ON_TOKEN] >= 0 && tokens[i * tstride] == t[T_ON_TOKEN]) ? t[T_ON_MATCH] : t[T_OTHERWISE];
        }
    }
}

/* child(out, nodes, tokens, n, child_ptr, child_token, num_nodes, table, num_codes, flags, filt, num_filters) -> None
 *
 * out[i] = the child of node nodes[i] by token tokens[i]; where there is none (or nodes[i] is not a node): -1 when
 * table is 0, else the step table's move for that state (trie_decode/spans.py: ON_MATCH on the token ON_TOKEN,
 * OTHERWISE on any other), so that one call is the whole state update.
 * Children of node m are m's CSR range child_ptr[m]..child_ptr[m+1]-1, sorted by token. The rows' binary searches
 * run in lockstep, one level for every row per pass, with the next probe prefetched: a big trie's arrays are out of
 * cache after every logits fill, and this way the rows' cache misses overlap instead of adding up.
 *
 * Filters (optional, with a step table): the per-node flags of mask() (bit 0: no usable entry below the node,
 * bit 1: the entry ending at the node is not usable). A child with bit 0 is no child for the row: its token
 * moves as a token off the trie does; a row that leaves a node with bit 1 set (not down a usable child) ends
 * (DONE), as at a node that ends no entry. */
static PyObject *py_child(PyObject *self, PyObject *args) {
    Py_ssize_t out_p, nodes_p, tokens_p, n, child_ptr_p, child_token_p, num_nodes, table_p, num_codes;
    Py_ssize_t flags_p, filt_p, num_filters;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnn", &out_p, &nodes_p, &tokens_p, &n, &child_ptr_p, &child_token_p, &num_nodes,
                          &table_p, &num_codes, &flags_p, &filt_p, &num_filters))
        return NULL;
    if (table_p && num_codes < 1) {
        PyErr_SetString(PyExc_ValueError, "a step table has at least one code row");
        return NULL;
    }
    if (flags_p && (!table_p || !filt_p || num_filters < 1)) {
        PyErr_SetString(PyExc_ValueError, "filter flags need the step table and each row's filter");
        return NULL;
    }
    if (flags_p && !filters_in_range((const int64_t *)filt_p, n, num_filters)) return NULL;
    int64_t *bounds = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(int64_t));
    if (!bounds) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    child_rows((int64_t *)out_p, (const int64_t *)nodes_p, (const int64_t *)tokens_p, 1, n, (const int32_t *)child_ptr_p,
               (const int32_t *)child_token_p, num_nodes, (const int32_t *)table_p, num_codes,
               (const uint8_t *)flags_p, (const int64_t *)filt_p, bounds);
    Py_END_ALLOW_THREADS
    free(bounds);
    Py_RETURN_NONE;
}

/* step(nodes, tokens, token_stride, parents, parent_stride, parent_size, moves, out, src, batch, out_stride,
 *      src_stride, width, elsize, neg_bits, floor_bits, n, table, num_nodes, num_codes, child_token, num_children,
 *      blocked, vt, num_dense, child_ptr) -> number of rows masked
 *
 * A whole decoding step of n rows that keep their places (logits row i is state row i), in one call: with tokens
 * (not 0), each row first moves from the node of its parent row (parents[i * parent_stride], parent_size-byte ints;
 * row i itself when parents is 0) by the token tokens[i * token_stride], as child() does (moves: 1 to take the span
 * rules' moves off the trie from the step table, 0 for plain rules); nodes (n int64) is updated in place. Then the rows are
 * masked as mask() does, without filters. The token and parent strides read them straight from the generation's
 * own arrays (the last column of input_ids, a column of beam search's parent indices). A parent outside [0, n)
 * raises IndexError before anything is written. */
static PyObject *py_step(PyObject *self, PyObject *args) {
    Py_ssize_t nodes_p, tokens_p, token_stride, parents_p, parent_stride;
    Py_ssize_t out_p, src_p, table_p, child_token_p, blocked_p, child_ptr_p;
    int parent_size, moves;
    unsigned long long neg_bits, floor_bits;
    MaskJob j;
    if (!PyArg_ParseTuple(args, "nnnnniinnnnnniKKnnnnnnnnnn", &nodes_p, &tokens_p, &token_stride, &parents_p,
                          &parent_stride, &parent_size, &moves, &out_p, &src_p, &j.batch, &j.out_stride,
                          &j.src_stride, &j.width, &j.es, &neg_bits, &floor_bits, &j.n, &table_p, &j.num_nodes,
                          &j.num_codes, &child_token_p, &j.num_children, &blocked_p, &j.vt, &j.num_dense, &child_ptr_p))
        return NULL;
    j.out = (char *)out_p, j.src = (const char *)src_p, j.neg_bits = neg_bits, j.floor_bits = floor_bits;
    j.rows = NULL, j.nodes = (const int64_t *)nodes_p, j.table = (const int32_t *)table_p;
    j.child_token = (const int32_t *)child_token_p, j.blocked = (const uint8_t *)blocked_p;
    j.child_ptr = (const int32_t *)child_ptr_p, j.flags = NULL, j.filt = NULL, j.num_filters = 0;
    if (!mask_job_check(&j)) return NULL;
    const Py_ssize_t n = j.n;
    int64_t *nodes = (int64_t *)nodes_p;
    if (parents_p && parent_size != 4 && parent_size != 8) {
        PyErr_Format(PyExc_ValueError, "parent indices must be 4- or 8-byte integers, got %d bytes", parent_size);
        return NULL;
    }
    /* scratch: the parents' nodes (n), the new nodes (n), the searches' bounds (2n) */
    int64_t *scratch = NULL;
    if (tokens_p && !(scratch = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * 4 * sizeof(int64_t)))) return PyErr_NoMemory();
    int64_t *from = scratch;
    if (tokens_p) {
        /* each row's parent node, every parent index checked before anything is written */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t parent = i;
            if (parents_p) {
                const char *p = (const char *)parents_p + i * parent_stride * parent_size;
                parent = parent_size == 4 ? *(const int32_t *)p : *(const int64_t *)p;
                if (parent < 0 || parent >= n) {
                    PyErr_Format(PyExc_IndexError, "row %zd names parent row %lld of %zd rows", i, (long long)parent, n);
                    free(scratch);
                    return NULL;
                }
            }
            from[i] = nodes[parent];
        }
    }
    Py_ssize_t masked;
    Py_BEGIN_ALLOW_THREADS
    if (tokens_p) {
        int64_t *next = scratch + n;
        child_rows(next, from, (const int64_t *)tokens_p, token_stride, n, j.child_ptr, j.child_token, j.num_nodes,
                   moves ? j.table : NULL, j.num_codes, NULL, NULL, scratch + 2 * n);
        memcpy(nodes, next, (size_t)n * sizeof(int64_t));
    }
    masked = mask_job_run(&j);
    Py_END_ALLOW_THREADS
    free(scratch);
    if (masked < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(masked);
}

static PyMethodDef methods[] = {
    {"mask", py_mask, METH_VARARGS, "Mask logits rows by their trie states (see _kernel.c)."},
    {"child", py_child, METH_VARARGS, "The child of each node by each token, or -1 (see _kernel.c)."},
    {"step", py_step, METH_VARARGS, "Advance rows that keep their places and mask their logits (see _kernel.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kernel", .m_doc = "trie_decode's fused CPU step.", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernel(void) { return PyModule_Create(&module); }
