/* gemm_reference.c: ggml_gemm's outputs for cases written by Python, for a reference check there
(tests/test_kernel_sanitized_reference.py builds it with the kernel sources under
-fsanitize=address,undefined, every warning an error, and compares what it writes with a float64
dequantize-then-matmul).

Contract: `gemm_reference CASE...` reads each CASE file: seven little-endian int64 (qtype, N, K, T,
nthreads, weight bytes, has_rowmap), the weight's bytes, then N int32 output rows when has_rowmap,
then T * K float32 activations. Every buffer is malloc'd to its exact size (a read or write one
byte outside is a heap-buffer-overflow). It runs the three entry points the library's callers use,
ggml_gemm (OpenMP or serial threads), ggml_gemm_pool (the pool's threads) and ggml_gemm_pool_rows
(each row as a one-row call), each into its own (T, N) output, and writes the three outputs, T * N
float32 each in that order, to CASE.out. Exit 0 when every case ran; 1 on an unreadable case or an
entry point returning non-zero (printed on stderr); a sanitizer report exits non-zero by itself.
Checking the numbers is the Python side's. */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ggml_gemm(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t, int);
int ggml_gemm_pool(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t, int);
int ggml_gemm_pool_rows(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t,
                        int);

typedef int (*entry_fn)(int, const uint8_t *, const float *, float *, const int32_t *, int64_t, int64_t, int64_t,
                        int);

static void *read_exact(FILE *f, size_t n) {
    void *p = malloc(n ? n : 1);
    if (p != NULL && n && fread(p, 1, n, f) != n) {
        free(p);
        return NULL;
    }
    return p;
}

static int run_case(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "%s: cannot open\n", path);
        return 1;
    }
    int64_t h[7];
    int rc = 1;
    uint8_t *w = NULL;
    int32_t *rowmap = NULL;
    float *x = NULL, *y = NULL;
    if (fread(h, sizeof h, 1, f) != 1) goto done;
    const int64_t qtype = h[0], N = h[1], K = h[2], T = h[3], nth = h[4], wbytes = h[5], mapped = h[6];
    if (N <= 0 || K <= 0 || T <= 0 || nth <= 0 || wbytes <= 0) goto done;
    w = read_exact(f, (size_t)wbytes);
    rowmap = mapped ? read_exact(f, (size_t)N * sizeof(int32_t)) : NULL;
    x = read_exact(f, (size_t)(T * K) * sizeof(float));
    y = malloc((size_t)(3 * T * N) * sizeof(float));
    if (w == NULL || (mapped && rowmap == NULL) || x == NULL || y == NULL) goto done;
    const entry_fn entries[3] = {ggml_gemm, ggml_gemm_pool, ggml_gemm_pool_rows};
    for (int e = 0; e < 3; e++) {
        int got = entries[e]((int)qtype, w, x, y + e * T * N, rowmap, N, K, T, (int)nth);
        if (got != 0) {
            fprintf(stderr, "%s: entry point %d returned %d\n", path, e, got);
            goto done;
        }
    }
    char out[4096];
    if (snprintf(out, sizeof out, "%s.out", path) >= (int)sizeof out) goto done;
    FILE *o = fopen(out, "wb");
    if (o == NULL) goto done;
    size_t n = (size_t)(3 * T * N);
    rc = fwrite(y, sizeof(float), n, o) == n ? 0 : 1;
    rc |= fclose(o) != 0;
done:
    if (rc) fprintf(stderr, "%s: failed\n", path);
    fclose(f);
    free(w);
    free(rowmap);
    free(x);
    free(y);
    return rc;
}

int main(int argc, char **argv) {
    int failed = 0;
    for (int i = 1; i < argc; i++) failed |= run_case(argv[i]);
    printf("cases: %d run, %s\n", argc - 1, failed ? "some failed" : "all ran");
    return failed;
}
